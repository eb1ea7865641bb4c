"""A CPU (or single-device) rollout engine on a transformers model with a KV cache.

The embedded default engine and the numerical reference for the engine/trainer
contract.  The model is built from the Hugging Face config
(``AutoModelForCausalLM.from_config``); its weights arrive through
:meth:`TorchRolloutEngine.update_weights` from the reshard stream (or from disk
with :meth:`TorchRolloutEngine.from_pretrained`, for evaluation).

Generation: prompts x n samples are processed in batches of ``max_batch_size``
rows, left-padded with an attention mask and explicit position ids, prefilled
once and then decoded one token per step through transformers' ``DynamicCache``.
Finished rows are dropped from the batch and the cache
(``torch/cache.keep_cache_rows``: the key/value layers and a hybrid model's recurrent states).  Weights arrive under their Hugging Face *checkpoint* names (what safetensors files
and vLLM's loader use).  transformers 5 keeps a mixture-of-experts layer's experts
fused (``mlp.experts.gate_up_proj`` [E, 2I, h], ``mlp.experts.down_proj`` [E, h, I])
while checkpoints hold one tensor per expert (``mlp.experts.{e}.gate_proj.weight``
...); the engine writes those into their slices of the fused parameters.

Sampling follows
:func:`~mcpo_megatron.rollout.engines.interface.process_logits` in float64: each row draws
one uniform per step from its own ``torch.Generator`` (seeded by
:func:`~mcpo_megatron.rollout.engines.interface.sample_seed`) and inverts the processed
CDF, so a sample's randomness does not depend on its batch.
"""

from __future__ import annotations

import gc
import re
from typing import Iterable, Sequence

import torch

from mcpo_megatron.rollout.engines.interface import (
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationInterrupted,
    RolloutEngine,
    RolloutOutput,
    RolloutSample,
    SamplingParams,
    process_logits,
    sample_seed,
)
from mcpo_megatron.rollout.engines.torch.cache import keep_cache_rows
from mcpo_megatron.rollout.engines.torch.session import TorchSession
from mcpo_megatron.rollout.weights.target import WeightTarget


# transformers' fused experts of a MoE layer: [E, 2I, h] (gate rows, then up rows) and [E, h, I].
_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def checkpoint_targets(named_params: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, tuple]]:
    """HF checkpoint name -> (parameter, index of the slice it fills) for a transformers model's parameters.

    Parameters map to themselves (empty index) except fused experts, which expand to one
    ``{prefix}.{e}.gate_proj/up_proj/down_proj.weight`` per expert.
    """
    out: dict[str, tuple[torch.Tensor, tuple]] = {}
    for name, param in named_params.items():
        m = _FUSED_EXPERTS.match(name)
        if m is None or param.dim() != 3:
            out[name] = (param, ())
            continue
        prefix = m["prefix"]
        for e in range(param.shape[0]):
            if m["kind"] == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = (param, (e,))
            else:
                inter = param.shape[1] // 2
                out[f"{prefix}.{e}.gate_proj.weight"] = (param, (e, slice(0, inter)))
                out[f"{prefix}.{e}.up_proj.weight"] = (param, (e, slice(inter, 2 * inter)))
    return out


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _dtype(value) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
             "float64": torch.float64, "fp64": torch.float64}
    if value not in table:
        raise ValueError(f"dtype={value!r} is not one of {sorted(table)}")
    return table[value]


class RoutingCapture:
    """The experts every MoE router of a transformers Qwen3-MoE model picks, forward call by forward call."""

    def __init__(self, model) -> None:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

        from mcpo_megatron.models.routing_replay import record_dtype

        routers = [m for m in model.modules() if isinstance(m, Qwen3MoeTopKRouter)]
        if not routers:
            raise ValueError("return_routed_experts needs a mixture-of-experts model (Qwen3-MoE); this one has no "
                             "routers")
        self.dtype = record_dtype(routers[0].num_experts)
        self._layers: list[torch.Tensor] = []
        for m in routers:  # model order = layer order
            m.register_forward_hook(lambda _m, _args, out: self._layers.append(out[2]))

    def take(self, rows: int, seq: int) -> torch.Tensor:
        """[rows, seq, num_layers, top-k] of the last forward call ([rows, seq] tokens)."""
        out = torch.stack([x.reshape(rows, seq, -1) for x in self._layers], dim=2).to("cpu", self.dtype)
        self._layers = []
        return out


class TorchRolloutEngine(RolloutEngine):
    """Batched KV-cache generation with a transformers causal LM.

    Args:
        hf_config: a transformers ``PretrainedConfig`` (Qwen3, Qwen2, Llama ...).
        dtype: weight / compute dtype of the model (float32 for the contract).
        device: where the model runs ("cpu", or a CUDA device for quick GPU checks).
        max_batch_size: rows (prompt x sample) decoded together.
        eos_token_ids: ids that always stop a response, in addition to
            ``SamplingParams.stop_token_ids``; default: ``hf_config.eos_token_id``.
        model: an already built model to wrap instead of building one from the config.
        return_routed_experts: MoE models: every sample carries the experts each of its tokens was routed to
            (``RolloutSample.routed_experts``; vLLM's option of the same name).
    """


    def __init__(self, hf_config, *, dtype=torch.float32, device="cpu", max_batch_size: int = 64,
                 eos_token_ids: Sequence[int] | int | None = None, model=None,
                 return_routed_experts: bool = False):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size!r} must be >= 1")
        self.hf_config = hf_config
        self.dtype = _dtype(dtype)
        self.device = torch.device(device)
        self.max_batch_size = int(max_batch_size)
        if model is None:
            from transformers import AutoModelForCausalLM
            from transformers.initialization import no_init_weights

            # Random init is wasted work: every weight is overwritten by update_weights.
            with no_init_weights():
                model = AutoModelForCausalLM.from_config(hf_config, dtype=self.dtype)
            # Tying is part of weight init, which no_init_weights skips.
            if getattr(hf_config, "tie_word_embeddings", False):
                model.tie_weights()
        self.model = model.to(self.device).eval()
        self.model.requires_grad_(False)
        if eos_token_ids is None:
            eos_token_ids = getattr(hf_config, "eos_token_id", None)
        self.eos_token_ids = _as_id_list(eos_token_ids)
        # remove_duplicate=False keeps tied names (lm_head.weight shares embed_tokens.weight).
        self._targets = checkpoint_targets(dict(self.model.named_parameters(remove_duplicate=False)))
        self._asleep = False
        self._routing = RoutingCapture(self.model) if return_routed_experts else None

    @classmethod
    def from_pretrained(cls, path, *, dtype=torch.float32, device="cpu", **kwargs) -> "TorchRolloutEngine":
        """Load config and weights from a Hugging Face directory (evaluation convenience)."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=_dtype(dtype))
        return cls(model.config, dtype=dtype, device=device, model=model, **kwargs)

    # ------------------------------------------------------------------ weights
    def weight_target(self) -> WeightTarget | None:
        """The model's parameters as Hugging Face tensors (layout "hf", a MoE layer's experts fused as transformers
        holds them), written in place by the reshard plan; None when the model's parameters are not exactly the
        tensors the plan expects (then the update takes the HF stream)."""
        from mcpo_megatron.models.registry import UnsupportedModelError, megatron_shape
        from mcpo_megatron.rollout.weights.layouts import EngineLayout, engine_tensor_shapes
        from mcpo_megatron.rollout.weights.transfer import dtype_name

        params = dict(self.model.named_parameters())  # a tied head appears once, as the embedding
        fused = any(_FUSED_EXPERTS.match(n) and p.dim() == 3 for n, p in params.items())
        try:
            layout = EngineLayout("hf", dtype_name(self.dtype), fused_experts=fused)
            expected = engine_tensor_shapes(megatron_shape(self.hf_config), layout)
        except (UnsupportedModelError, ValueError):
            return None
        if any(k not in params or tuple(params[k].shape) != s or not params[k].is_contiguous()
               for k, s in expected.items()):
            return None
        return WeightTarget(layout, {k: params[k] for k in expected}, begin=lambda: self._check_awake("a weight update"))

    def weight_names(self) -> list[str]:
        """The HF checkpoint names :meth:`update_weights` accepts (tied names included)."""
        return list(self._targets)

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._check_awake("update_weights")
        for name, tensor in named_tensors:
            target = self._targets.get(name)
            if target is None:
                raise KeyError(
                    f"update_weights: {name!r} is not a parameter of the "
                    f"{type(self.model).__name__} built from the config; known names start with "
                    f"{sorted(self._targets)[:4]}... (check the HF name mapping)"
                )
            param, index = target
            dest = param[index] if index else param
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"update_weights: {name!r} has shape {tuple(tensor.shape)} but the engine "
                    f"expects {tuple(dest.shape)}"
                )
            dest.copy_(tensor)

    # ------------------------------------------------------------------ memory
    def sleep(self) -> None:
        """On CPU there is no persistent KV cache (it lives inside ``generate``); sleeping
        collects garbage so the freed cache returns to the allocator, and marks the
        engine as asleep (``generate`` / ``update_weights`` then raise until ``wake_up``).
        Weights stay in place: the training process shares the same RAM anyway."""
        self._asleep = True
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        self._asleep = False

    def _check_awake(self, what: str) -> None:
        if self._asleep:
            raise RuntimeError(f"TorchRolloutEngine.{what} called while asleep; call wake_up() first")

    # ------------------------------------------------------------------ generation
    @torch.inference_mode()
    def generate(self, prompts_token_ids: list[list[int]], sampling: SamplingParams, *,
                 prompt_indices: Sequence[int] | None = None, should_stop=None) -> RolloutOutput:
        self._check_awake("generate")
        prompt_indices = list(range(len(prompts_token_ids)) if prompt_indices is None else prompt_indices)
        if len(prompt_indices) != len(prompts_token_ids):
            raise ValueError(
                f"generate: {len(prompts_token_ids)} prompts but {len(prompt_indices)} prompt_indices"
            )
        for j, p in zip(prompt_indices, prompts_token_ids):
            if len(p) == 0:
                raise ValueError(f"generate: prompt {j} is empty; every prompt needs at least one token")
        rows = [(j, i, list(p)) for j, p in zip(prompt_indices, prompts_token_ids) for i in range(sampling.n)]
        stop_ids = sorted(set(self.eos_token_ids) | set(sampling.stop_token_ids))
        samples: list[RolloutSample] = []
        for b in range(0, len(rows), self.max_batch_size):
            samples.extend(self._generate_batch(rows[b:b + self.max_batch_size], sampling, stop_ids,
                                                should_stop))
        return RolloutOutput(samples)

    def open_session(self, prompts_token_ids, records, sampling: SamplingParams):
        """Generate ``records`` in segments (partial rollouts): ``rollout/engines/torch/session.py``."""
        self._check_awake("generate")
        return TorchSession(self, prompts_token_ids, records, sampling)

    def _forward(self, input_ids, attention_mask, position_ids, cache):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :], out.past_key_values

    def _generate_batch(self, rows, sampling: SamplingParams, stop_ids: list[int],
                        should_stop=None) -> list[RolloutSample]:
        dev = self.device
        bsz = len(rows)
        max_new = sampling.max_new_tokens
        lens = [len(p) for _, _, p in rows]
        width = max(lens)
        input_ids = torch.zeros(bsz, width, dtype=torch.long)
        attention_mask = torch.zeros(bsz, width, dtype=torch.long)
        for r, (_, _, p) in enumerate(rows):  # left padding: the last column is every row's last token
            input_ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
            attention_mask[r, width - len(p):] = 1
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        # One uniform per (row, step) from the row's own generator: independent of batching.
        uniforms = torch.empty(bsz, max_new, dtype=torch.float64)
        if not sampling.greedy:
            for r, (j, i, _) in enumerate(rows):
                g = torch.Generator().manual_seed(sample_seed(sampling.seed, j, i))
                uniforms[r] = torch.rand(max_new, generator=g, dtype=torch.float64)
        stop_t = torch.tensor(stop_ids, dtype=torch.long)

        tokens = torch.zeros(bsz, max_new, dtype=torch.long)
        logps = torch.zeros(bsz, max_new, dtype=torch.float64)
        length = torch.zeros(bsz, dtype=torch.long)
        stopped = torch.zeros(bsz, dtype=torch.bool)

        active = torch.arange(bsz)  # original row of each live batch row
        attention_mask, position_ids = attention_mask.to(dev), position_ids.to(dev)
        logits, cache = self._forward(input_ids.to(dev), attention_mask, position_ids, None)
        routes = None
        if self._routing is not None:  # per row, the prompt's routing (left padding dropped), then one per token
            prefill = self._routing.take(bsz, width)
            routes = [[prefill[r, width - n:]] for r, n in enumerate(lens)]
        next_pos = position_ids[:, -1:] + 1
        for t in range(max_new):
            if should_stop is not None and should_stop():
                raise GenerationInterrupted(f"stopped after {t} decoding steps")
            tok, lp = self._sample(logits, sampling, uniforms[active, t])
            tokens[active, t] = tok
            logps[active, t] = lp
            length[active] = t + 1
            hit_stop = torch.isin(tok, stop_t) if len(stop_ids) else torch.zeros_like(tok, dtype=torch.bool)
            stopped[active] = hit_stop
            keep = ~hit_stop
            if t == max_new - 1 or not bool(keep.any()):
                break
            if not bool(keep.all()):
                keep_idx = keep.nonzero().squeeze(-1)
                active = active[keep_idx]
                keep_cache_rows(cache, keep_idx.to(dev))
                attention_mask = attention_mask[keep_idx.to(dev)]
                next_pos = next_pos[keep_idx.to(dev)]
                tok = tok[keep_idx]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(active), 1)], dim=1)
            logits, cache = self._forward(tok.to(dev).unsqueeze(-1), attention_mask, next_pos, cache)
            if routes is not None:
                step = self._routing.take(len(active), 1)
                for k, r in enumerate(active.tolist()):
                    routes[r].append(step[k])
            next_pos = next_pos + 1
        del cache, logits

        out = []
        for r, (j, i, _) in enumerate(rows):
            n_tok = int(length[r])
            out.append(RolloutSample(
                prompt_index=int(j), sample_index=int(i),
                token_ids=tokens[r, :n_tok].tolist(), logprobs=logps[r, :n_tok].tolist(),
                finish_reason=FINISH_STOP if bool(stopped[r]) else FINISH_LENGTH,
                routed_experts=None if routes is None else torch.cat(routes[r])[: lens[r] + n_tok - 1],
            ))
        return out

    @staticmethod
    def _sample(logits: torch.Tensor, sampling: SamplingParams, u: torch.Tensor):
        """Draw one token per row by inverting the processed CDF at ``u``; return (token, logp)."""
        z = process_logits(logits.double().cpu(), sampling.temperature, sampling.top_p, sampling.top_k)
        logp = torch.log_softmax(z, dim=-1)
        if sampling.greedy:
            tok = z.argmax(dim=-1)
        else:
            probs = logp.exp()
            cdf = probs.cumsum(dim=-1)
            target = (u * cdf[:, -1]).unsqueeze(-1)
            tok = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=z.shape[-1] - 1)
            # Rounding at the top end could land on a removed token: fall back to the mode.
            bad = probs.gather(-1, tok.unsqueeze(-1)).squeeze(-1) <= 0
            if bool(bad.any()):
                tok = torch.where(bad, z.argmax(dim=-1), tok)
        return tok, logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
