"""The trainable policy: a Hugging Face model on Megatron TP x PP x DP, with the loss on device.

``MegatronPolicy`` builds this rank's pipeline stage with
:func:`~mcpo_megatron.models.builder.build_gpt_model`, loads the Hugging Face weights
into its TP/PP slices, wraps it in megatron-core's ``DistributedDataParallel`` and builds
megatron's (distributed) Adam optimizer and LR scheduler.  Two calls do the work:

* :meth:`MegatronPolicy.compute_logprobs` - forward only; per-sequence log-probs and
  entropy of the response tokens, on every rank of the DP group that was given the batch.
* :meth:`MegatronPolicy.train_step` - forward-backward with the caller's loss, then one
  optimizer step.

Micro-batches come from a padded-token budget (:func:`~mcpo_megatron.models.batch.split_by_token_budget`)
and are padded one by one, so they have different sequence lengths.  All micro-batches of
a call go through ONE pipeline-schedule call with ``config.variable_seq_lengths=True``:
megatron's p2p layer then sends each activation's shape ahead of it, so stages agree on
every micro-batch's [S, b, h] without a fixed ``seq_length``.  (One schedule call per
micro-batch would also work, but would run DP gradient reduction once per micro-batch and
drain the pipeline every time.)

Interleaved pipelines (virtual pipeline size > 1): each rank holds one model chunk per
virtual stage, each wrapped in its own DDP; megatron's interleaved 1F1B schedule runs them.
It needs a multiple of the pipeline size micro-batches of one fixed shape
(:func:`~mcpo_megatron.models.batch.fixed_shape_microbatches`: every sequence padded to the
longest, filler micro-batches that contribute neither loss, gradient nor results), and at
PP = 2 unbatched p2p (megatron's ``_p2p_ops`` keeps the two directions to the one neighbour on
separate communicators; its batched path would cross them).

Mixture of experts: experts are split over the expert-parallel ranks (megatron DDP reduces
their gradients over the expert-data-parallel group, the optimizer shards them there).  The
expert-parallel group spans data-parallel ranks and every MoE layer's forward meets it in an
all-to-all, so with EP > 1 each pass first agrees on the largest micro-batch count over the
DP group and ranks with fewer run filler micro-batches (no loss, no gradient, no results); the
routers' expert load and the optional load-balancing loss are handled by
:class:`~mcpo_megatron.models.moe_balance.LoadBalanceMonitor`.

Log-probs are computed on the last stage from the vocab-parallel logits ([b, S, V/tp];
``GPTModel`` called without labels and with ``parallel_output=True`` never gathers the
vocabulary): the response positions are gathered first ([b, T, V/tp]) and handed to
:func:`~mcpo_megatron.parallel.logprobs.vocab_parallel_logprobs`, which works in token
chunks with TP all-reduces.

Gradient scaling (why the gradient is that of the global SUM):
``loss_fn`` returns a sum of per-token terms that already carry global weights
(``algorithms.losses.token_weights``), so the mini-batch loss is the plain sum over
micro-batches and DP ranks.  Megatron by default divides each micro-batch loss by the
number of micro-batches and DDP averages gradients over DP.  We switch both off:
``config.calculate_per_token_loss=True`` together with a 3-tuple ``loss_func`` return
makes the schedule skip the 1/num_microbatches division and makes DDP *sum* over DP
(its gradient_scaling_factor becomes 1); megatron would then divide by the global token
count in ``finalize_model_grads``, so we install a ``finalize_model_grads_func`` that
passes ``num_tokens=None`` (no division).  The tests compare the resulting gradients with
a single-process autograd reference for 1 vs 4 micro-batches and DP=1 vs DP=2.
"""

from __future__ import annotations

import math
import os
from functools import partial
from typing import Any, Callable

import torch

from mcpo_megatron.models.batch import (
    MicroBatch,
    SequenceBatch,
    fixed_shape_microbatches,
    make_microbatches,
    pad_microbatch_count,
    unpad_response,
)
from mcpo_megatron.models.optim import OptimSettings, build_optimizer, build_scheduler
from mcpo_megatron.parallel.distributed import all_reduce_max, all_reduce_sum, broadcast

LossFn = Callable[[torch.Tensor, torch.Tensor | None, MicroBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]]

# Common (non-sharded) checkpoint entries.
_SCHEDULER_KEY = "lr_scheduler"
_OPTIM_SHARDING = {"distrib_optim_sharding_type": "dp_reshardable"}
# model.recompute_activations: what mcpo plan's activation estimate assumes.
_RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def _finalize_grads_as_sum(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
    """megatron's ``finalize_model_grads`` without the division by the global token count.

    The policy loss is already normalised by global counts (per-token weights), so the
    gradient wanted is that of the plain sum; DDP sums over DP because
    ``calculate_per_token_loss`` is on.
    """
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)


def set_schedule_options(chunks: list, pp: int) -> None:
    """Pipeline-schedule options of this rank's model chunks (see the module docstring)."""
    for model in chunks:
        # Set after construction: TransformerConfig's validation rejects variable_seq_lengths
        # with the (unused, MoE-only) default allgather token dispatcher.  The interleaved
        # schedule runs fixed shapes instead.
        model.config.variable_seq_lengths = len(chunks) == 1
        if len(chunks) > 1 and pp == 2:
            model.config.batch_p2p_comm = False


def _default_dtype() -> torch.dtype:
    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


def _as_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    if dtype is None:
        return _default_dtype()
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32,
             "float32": torch.float32, "auto": _default_dtype()}
    if dtype not in names:
        raise ValueError(f"dtype={dtype!r} must be one of {sorted(names)}")
    return names[dtype]


class MegatronPolicy:
    """A Megatron ``GPTModel`` stage + DDP + distributed optimizer + LR schedule.

    Args:
        hf_dir: Hugging Face model directory (config.json + safetensors).
        parallel_info: this rank's layout (``init_distributed``); read from megatron's
            ``parallel_state`` when None.
        dtype: parameter dtype; default bf16 with CUDA, fp32 on CPU.
        optim: optimizer / LR-schedule settings (see :class:`OptimSettings.from_config`).
        max_tokens_per_microbatch: padded-token budget of one micro-batch (b * S_max).
        logprob_chunk_size: tokens per chunk in the vocab-parallel log-prob kernel.
        temperature: logits are divided by it before the softmax (must equal the rollout's).
        load_weights: load the HF weights (False keeps megatron's random init; for benchmarks).
        transformer_impl: "auto" (TE on GPUs when installed, else local), "local" or
            "transformer_engine".
        hf_config: an already loaded HF config (skips reading ``hf_dir/config.json``).
        sequence_parallel: split activations outside the TP-parallel matmuls along the
            sequence (needs TP > 1; ignored at TP = 1; required for MoE at TP > 1).
        recompute_activations: keep only each layer's input for backward and run the layer
            again there (megatron's full, uniform recomputation of 1 layer at a time).
        moe_aux_loss_coeff: weight of the MoE load-balancing loss in the gradient (0: the
            load is only reported; see :mod:`~mcpo_megatron.models.moe_balance`).
        overlap_grad_reduce: megatron DDP reduces each gradient bucket as soon as the backward pass has
            produced it, overlapping communication with the rest of the backward.
        overlap_param_gather: the distributed optimizer's parameter all-gather after a step is deferred to
            the next forward and overlapped with it (bucket by bucket); until then only this rank's shard of
            the parameters is updated, so readers outside a forward call :meth:`sync_params` first.
        moe_routing_replay: "off", "r2" (:meth:`compute_logprobs` records each token's experts into a batch
            that has no record, later passes over it replay them) or "r3" (passes replay the batch's record,
            the engine's); see :mod:`~mcpo_megatron.models.routing_replay`.
    """

    def __init__(
        self,
        hf_dir: str | os.PathLike | None,
        *,
        parallel_info=None,
        dtype: torch.dtype | str | None = None,
        optim: OptimSettings | None = None,
        max_tokens_per_microbatch: int = 8192,
        logprob_chunk_size: int = 4096,
        temperature: float = 1.0,
        load_weights: bool = True,
        transformer_impl: str = "auto",
        hf_config: Any = None,
        sequence_parallel: bool = False,
        moe_aux_loss_coeff: float = 0.0,
        recompute_activations: bool = False,
        overlap_grad_reduce: bool = False,
        overlap_param_gather: bool = False,
        moe_routing_replay: str = "off",
    ) -> None:
        from mcpo_megatron.parallel.distributed import parallel_info as _parallel_info

        # The policy's own argument names: the config keys they come from are checked, and named, by the schema.
        if not temperature > 0:
            raise ValueError(f"MegatronPolicy: temperature={temperature!r} must be > 0 (logits are divided by it)")
        if not moe_aux_loss_coeff >= 0:
            raise ValueError(f"MegatronPolicy: moe_aux_loss_coeff={moe_aux_loss_coeff!r} must be >= 0")
        if not isinstance(max_tokens_per_microbatch, int) or max_tokens_per_microbatch < 1:
            raise ValueError(
                f"MegatronPolicy: max_tokens_per_microbatch={max_tokens_per_microbatch!r} must be a positive integer"
            )
        self.info = parallel_info if parallel_info is not None else _parallel_info()
        self.dtype = _as_dtype(dtype)
        self.optim_settings = optim if optim is not None else OptimSettings()
        if overlap_param_gather and not self.optim_settings.use_distributed_optimizer:
            raise ValueError("MegatronPolicy: overlap_param_gather=True needs the distributed optimizer "
                             "(OptimSettings(use_distributed_optimizer=True)), whose all-gather it overlaps")
        self.max_tokens_per_microbatch = max_tokens_per_microbatch
        self.logprob_chunk_size = int(logprob_chunk_size)
        self.temperature = float(temperature)
        self.hf_dir = None if hf_dir is None else str(hf_dir)
        self.hf_config = hf_config if hf_config is not None else self._read_hf_config()

        chunks = self._build_chunks(transformer_impl, sequence_parallel, recompute_activations, load_weights)
        shape = chunks[0].mcpo_shape
        self.vocab_size = int(shape.vocab_size)
        self.overlap_param_gather = bool(overlap_param_gather)
        self._params_stale = False  # a step's all-gather is still pending (overlap_param_gather)
        self._wrap_for_training(chunks, overlap_grad_reduce=bool(overlap_grad_reduce))
        self.moe_monitor = self._load_balance_monitor(chunks, shape, moe_aux_loss_coeff) if shape.is_moe else None
        from mcpo_megatron.models.routing_replay import attach_routing_replay

        self.routing = attach_routing_replay(chunks, shape, moe_routing_replay, self.info,
                                             sequence_parallel=self.config.sequence_parallel)

    def _read_hf_config(self):
        if self.hf_dir is None:
            raise ValueError("MegatronPolicy needs hf_dir or hf_config")
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.hf_dir)

    def _build_chunks(self, transformer_impl: str, sequence_parallel: bool, recompute_activations: bool,
                      load_weights: bool) -> list:
        """This rank's model chunks (one per virtual pipeline stage), with the HF weights when asked."""
        from mcpo_megatron.models.builder import build_model_chunks

        chunks = build_model_chunks(
            self.hf_config,
            dtype=self.dtype,
            transformer_impl=transformer_impl,
            config_overrides={"calculate_per_token_loss": True, **(_RECOMPUTE if recompute_activations else {})},
            sequence_parallel=bool(sequence_parallel) and self.info.tp > 1,
        )
        set_schedule_options(chunks, self.info.pp)
        if load_weights:
            if self.hf_dir is None:
                raise ValueError("load_weights=True needs hf_dir")
            from mcpo_megatron.models.hf_io import load_hf_weights

            load_hf_weights(chunks, self.hf_dir)
        return chunks

    def _wrap_for_training(self, chunks: list, *, overlap_grad_reduce: bool) -> None:
        """Megatron DDP around each chunk (gradients reduced in fp32, summed: the loss is already a global
        share), the optimizer and LR schedule, and the pipeline schedule's hooks into them."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=overlap_grad_reduce,
            overlap_param_gather=self.overlap_param_gather,
            use_distributed_optimizer=self.optim_settings.use_distributed_optimizer,
            average_in_collective=False,
        )
        self.ddps = [DistributedDataParallel(config=m.config, ddp_config=ddp_config, module=m) for m in chunks]
        self.optimizer = build_optimizer(self.ddps, self.optim_settings, bf16=self.dtype == torch.bfloat16)
        self.scheduler = build_scheduler(self.optimizer, self.optim_settings)

        no_sync = [d.no_sync for d in self.ddps]
        for model in chunks:
            config = model.config
            config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
            config.finalize_model_grads_func = _finalize_grads_as_sum
            config.grad_scale_func = self.optimizer.scale_loss

    def _load_balance_monitor(self, chunks: list, shape, coeff: float):
        """The MoE load report and, with ``coeff`` > 0, the load-balancing loss (models/moe_balance)."""
        from megatron.core import parallel_state as ps

        from mcpo_megatron.models.moe_balance import LoadBalanceMonitor

        return LoadBalanceMonitor(
            chunks, num_layers=shape.num_layers, num_experts=shape.num_experts, topk=shape.moe_topk,
            coeff=coeff, sequence_parallel=self.config.sequence_parallel,
            tp_group=ps.get_tensor_model_parallel_group(), dp_group=self.info.dp_group,
            pp_group=self.info.pp_group, device=self.info.device)

    # ------------------------------------------------------------------ properties
    @property
    def model_chunks(self) -> list:
        """Bare ``GPTModel`` chunks of this rank (one per virtual pipeline stage) for export / reshard."""
        return [d.module for d in self.ddps]

    @property
    def model(self):
        """The bare ``GPTModel`` of this pipeline stage (one chunk only; see :attr:`model_chunks`)."""
        return self.ddp.module

    @property
    def ddp(self):
        """The DDP-wrapped model (one chunk only; with a virtual pipeline see ``ddps``)."""
        if len(self.ddps) != 1:
            raise AttributeError(f"this policy has {len(self.ddps)} model chunks (virtual pipeline); use ddps")
        return self.ddps[0]

    @property
    def config(self):
        return self.ddps[0].module.config

    # ------------------------------------------------------------------ internals
    def _microbatches(self, batch: SequenceBatch) -> list[MicroBatch]:
        """Token-budget micro-batches; with a virtual pipeline, fixed-shape ones (module docstring); as many on
        every data-parallel rank as on the busiest one when expert parallelism spans them."""
        # Sequence parallelism splits the sequence over TP ranks.
        multiple = self.info.tp if self.config.sequence_parallel else 1
        fixed = len(self.ddps) > 1
        if fixed:
            mbs = fixed_shape_microbatches(batch, self.max_tokens_per_microbatch, self.info.pp,
                                           seq_multiple=multiple)
        else:
            mbs = make_microbatches(batch, self.max_tokens_per_microbatch, seq_multiple=multiple)
        if self.info.ep > 1:
            mbs = pad_microbatch_count(mbs, self._busiest_dp_rank_count(len(mbs)), seq_multiple=multiple,
                                       fixed_shape=fixed)
        return [mb.to(self.info.device) for mb in mbs]

    def _busiest_dp_rank_count(self, count: int) -> int:
        """The largest micro-batch count over the data-parallel group (collective).

        Every MoE layer's forward runs megatron's token all-to-all over the expert-parallel group, whose ranks
        are data-parallel peers that split their own shares by the token budget: a rank with fewer micro-batches
        would leave its peers waiting in the all-to-all.  The DP group holds every EP group of this rank's stage.
        One int64 on the training device (NCCL on GPUs), every DP rank calls it once per pass."""
        n = torch.tensor([count], dtype=torch.int64, device=self.info.device)
        all_reduce_max(n, self.info.dp_group)
        return int(n.item())

    def _forward(self, model, mb: MicroBatch):
        """One chunk's forward of ``mb``; MoE routers get the padding mask (True on padding and fillers)."""
        if self.moe_monitor is None:
            return model(mb.input_ids, mb.position_ids, None)
        with self.routing.micro_batch(model, mb):
            return model(mb.input_ids, mb.position_ids, None, padding_mask=~mb.token_mask())

    def _set_train(self, training: bool) -> None:
        for d in self.ddps:
            d.train(training)

    def _response_logprobs(self, logits: torch.Tensor, mb: MicroBatch, compute_entropy: bool):
        """[b, T] log-probs (and entropy) of ``mb``'s response tokens from [b, S, V/tp] logits."""
        from megatron.core import parallel_state as ps

        from mcpo_megatron.parallel.logprobs import vocab_parallel_logprobs

        tp = self.info.tp
        if logits.dim() != 3 or logits.shape[-1] * tp != self.vocab_size:
            raise RuntimeError(
                f"expected vocab-parallel logits [b, S, {self.vocab_size}/{tp}], got {tuple(logits.shape)}"
            )
        index = mb.resp_index.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
        selected = torch.gather(logits, 1, index)  # [b, T, V/tp]; never the full vocabulary
        logp, entropy = vocab_parallel_logprobs(
            selected,
            mb.targets,
            ps.get_tensor_model_parallel_group(),
            chunk_size=self.logprob_chunk_size,
            temperature=self.temperature,
            compute_entropy=compute_entropy,
            # `selected` is a fresh gather output used by nothing else: its storage can
            # take the gradient, saving one [b, T, V/tp] buffer.
            inplace_backward=True,
        )
        # Padding positions carry no loss and no gradient.
        logp = logp.float().masked_fill(~mb.mask, 0.0)
        if entropy is not None:
            entropy = entropy.float().masked_fill(~mb.mask, 0.0)
        return logp, entropy

    def _run_schedule(self, mbs: list[MicroBatch], forward_step, *, forward_only: bool):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def step(data_iterator, model):
            return forward_step(next(data_iterator), model)

        many = len(self.ddps) > 1  # interleaved: one iterator per chunk, each over every micro-batch
        # A forward waits for every bucket's pending parameter all-gather (megatron's forward pre-hooks).
        self._params_stale = False
        return get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=[iter(mbs) for _ in self.ddps] if many else iter(mbs),
            model=self.ddps,
            num_microbatches=len(mbs),
            # Ignored with variable_seq_lengths (shapes travel with the activations); else every shape.
            seq_length=max(mb.seq_length for mb in mbs),
            micro_batch_size=max(len(mb.input_ids) for mb in mbs),
            forward_only=forward_only,
        )

    def _pp_last_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_pipeline_model_parallel_last_rank()

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def compute_logprobs(
        self, batch: SequenceBatch, *, compute_entropy: bool = True
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Per-sequence fp32 log-probs (and entropy) of the response tokens, in batch order.

        Runs forward-only through megatron's pipeline schedule; results are computed on the
        last stage and broadcast over the pipeline group, so every rank returns them.
        Entropy is None when ``compute_entropy`` is False.
        """
        all_mbs = self._microbatches(batch)
        self._set_train(False)
        self.routing.begin(batch, may_record=True)

        def loss_func(mb: MicroBatch, logits: torch.Tensor):
            if mb.filler:
                return logits.new_zeros(()), {}
            logp, ent = self._response_logprobs(logits, mb, compute_entropy)
            out = {"logp": logp}
            if ent is not None:
                out["entropy"] = ent
            return logits.new_zeros(()), out

        def forward_step(mb, model):
            return self._forward(model, mb), partial(loss_func, mb)

        store = self._run_schedule(all_mbs, forward_step, forward_only=True)
        self._set_train(True)
        self.routing.finish(batch)
        # Results of the real micro-batches (fillers come last and return nothing).
        mbs = [mb for mb in all_mbs if not mb.filler]
        store = store[: len(mbs)]

        # One flat buffer per call: [logp of every micro-batch..., entropy...].
        sizes = [mb.mask.numel() for mb in mbs]
        n_fields = 2 if compute_entropy else 1
        flat = torch.empty(n_fields * sum(sizes), dtype=torch.float32, device=self.info.device)
        if self.info.is_last_stage:
            parts = [out["logp"].reshape(-1) for out in store]
            if compute_entropy:
                parts += [out["entropy"].reshape(-1) for out in store]
            flat.copy_(torch.cat(parts))
        if self.info.pp > 1:  # on the training device (NCCL on GPUs)
            broadcast(flat, src=self.info.pp - 1, group=self.info.pp_group)

        logps: list[torch.Tensor | None] = [None] * len(batch)
        ents: list[torch.Tensor | None] = [None] * len(batch)
        offset = 0
        chunks = []
        for mb, n in zip(mbs, sizes):
            chunks.append(flat[offset : offset + n].view_as(mb.mask))
            offset += n
        for mb, lp in zip(mbs, chunks):
            for i, v in zip(mb.indices, unpad_response(lp, mb)):
                logps[i] = v.cpu()
        if compute_entropy:
            for mb, n in zip(mbs, sizes):
                en = flat[offset : offset + n].view_as(mb.mask)
                offset += n
                for i, v in zip(mb.indices, unpad_response(en, mb)):
                    ents[i] = v.cpu()
            return logps, ents
        return logps, None

    def forward_backward(self, batch: SequenceBatch, loss_fn: LossFn) -> dict[str, float]:
        """Zero the gradients, then forward-backward over the micro-batches of ``batch``.

        After it, the (DP-summed) gradient of the global loss sum sits in the DDP grad
        buffers (``param.main_grad``).  Returns the metric sums (see :meth:`train_step`).
        """
        mbs = self._microbatches(batch)
        self._set_train(True)
        for d in self.ddps:
            d.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.moe_monitor is not None:
            # A CPU scalar (gloo with the default backend map).
            real = torch.tensor([float(sum(int(mb.token_mask().sum()) for mb in mbs))], dtype=torch.float64)
            all_reduce_sum(real, self.info.dp_group)
            self.moe_monitor.begin(int(real.item()))
        self.routing.begin(batch, may_record=False)

        def loss_func(mb: MicroBatch, logits: torch.Tensor):
            if mb.filler:  # no loss; a zero that still reaches every parameter through the graph
                zero = torch.tensor(0, dtype=torch.int, device=logits.device)
                return logits.sum() * 0.0, zero, {}
            logp, ent = self._response_logprobs(logits, mb, True)
            loss, metric_sums = loss_fn(logp, ent, mb)
            reduced = {"loss": loss.detach().float().reshape(())}
            for k, v in metric_sums.items():
                reduced[k] = torch.as_tensor(v).detach().float().reshape(()).to(loss.device)
            # 3-tuple + calculate_per_token_loss: the schedule neither divides by the
            # token count nor by the number of micro-batches (see module docstring).
            n_tok = torch.tensor(mb.num_response_tokens, dtype=torch.int, device=loss.device)
            return loss, n_tok, reduced

        def forward_step(mb, model):
            return self._forward(model, mb), partial(loss_func, mb)

        store = self._run_schedule(mbs, forward_step, forward_only=False)
        n_real = sum(1 for mb in mbs if not mb.filler)
        metrics = self._reduce_metrics(store[:n_real], n_real, len(mbs) - n_real)
        if self.moe_monitor is not None:
            metrics.update(self.moe_monitor.finish())
        metrics.update(self.routing.finish(batch))
        return metrics

    def _reduce_metrics(self, store: list[dict], num_microbatches: int, num_fillers: int) -> dict[str, float]:
        """Sum metric dicts over micro-batches (last stage) and DP; broadcast over PP."""
        from mcpo_megatron.parallel.distributed import broadcast_object

        keys: list[str] | None = None
        values = None
        if self.info.is_last_stage:
            keys = sorted(store[0].keys()) if store else ["loss"]
            values = torch.zeros(len(keys) + 2, dtype=torch.float64, device=self.info.device)
            for out in store:
                values[:-2] += torch.stack([out[k].double() for k in keys])
            values[-2:] = torch.tensor([num_microbatches, num_fillers], dtype=torch.float64)
            all_reduce_sum(values, self.info.dp_group)  # on the training device
            payload = (keys, values.cpu().tolist())
        else:
            payload = None
        if self.info.pp > 1:
            payload = broadcast_object(payload, src=self._pp_last_rank(), group=self.info.pp_group)
        keys, vals = payload
        out = {k: float(v) for k, v in zip(keys, vals[:-2])}
        out["num_microbatches"], out["num_filler_microbatches"] = int(vals[-2]), int(vals[-1])
        return out

    def train_step(self, batch: SequenceBatch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on ``batch`` (this DP rank's share of the mini-batch).

        ``loss_fn(logp, entropy, mb) -> (loss, metric_sums)`` is called on the last stage per
        micro-batch with [b, T] fp32 tensors; ``loss`` must be a sum of globally weighted
        per-token terms.  The gradient applied is that of the sum of ``loss`` over all
        micro-batches and DP ranks.

        Returns (same values on every rank): "loss" and every metric sum, summed over
        micro-batches and DP ranks; "num_microbatches" (summed over DP); "num_filler_microbatches" (passes
        without data: the interleaved schedule's multiple of PP, the busiest DP rank's count under expert
        parallelism; summed over DP); "grad_norm"
        (global, before clipping; NaN when skipped); "lr" (used by this step); "skipped"
        (1.0 when the update was skipped because a gradient was NaN/Inf on some rank; the
        weights, optimizer state and LR schedule are then left as they were).
        """
        metrics = self.forward_backward(batch, loss_fn)
        lr = float(self.optimizer.param_groups[0]["lr"])
        if self._grads_finite():
            ok, grad_norm, _ = self.optimizer.step()
        else:
            # A NaN/Inf anywhere would poison every weight through Adam: skip the update.
            ok, grad_norm = False, math.nan
            for d in self.ddps:
                d.zero_grad_buffer()
            self.optimizer.zero_grad()
        if ok:
            self.scheduler.step(increment=1)
            self._params_stale = self.overlap_param_gather
        metrics.update(
            grad_norm=float(grad_norm) if grad_norm is not None else math.nan,
            lr=lr,
            skipped=0.0 if ok else 1.0,
        )
        return metrics

    def sync_params(self) -> None:
        """Make every rank's parameters the updated ones (collective).  With ``overlap_param_gather`` the
        all-gather after an optimizer step waits for the next forward; whatever reads the parameters outside a
        forward (resharding into the engine, checkpoints) calls this first.  A no-op otherwise."""
        if self._params_stale:
            for d in self.ddps:
                d.start_param_sync(force_sync=True)
            self._params_stale = False

    def _grads_finite(self) -> bool:
        """True when every rank's gradient buffers are finite (one MAX all-reduce over the world).

        Checked on the whole local buffer before the optimizer step: a non-finite local
        gradient reaches its owner's shard in the DP reduction, so checking every rank's
        full buffer covers every parameter.
        """
        bad = torch.zeros(1, dtype=torch.float32, device=self.info.device)
        for buf in (b for d in self.ddps for b in d.buffers + d.expert_parallel_buffers):
            if not bool(torch.isfinite(buf.grad_data).all()):
                bad.fill_(1.0)
                break
        all_reduce_max(bad)  # on the training device, over the world
        return bool(bad.item() == 0.0)

    # ------------------------------------------------------------------ checkpoints
    def sharded_state_dict(self, *, is_loading: bool = False) -> dict:
        """Model (from the bare chunks), optimizer (dp-reshardable) and scheduler state."""
        model_sd = model_sharded_state_dict(self.model_chunks)
        optim_sd = self.optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=dict(_OPTIM_SHARDING)
        )
        return {**model_sd, "optimizer": optim_sd, _SCHEDULER_KEY: self.scheduler.state_dict()}

    def save_checkpoint(self, directory: str | os.PathLike) -> None:
        """Write this policy's state into ``directory`` (collective; every rank calls it).

        The caller owns atomicity (write into a temporary directory, then rename).
        """
        from megatron.core import dist_checkpointing

        from mcpo_megatron.models.checkpoint_writer import start_checkpoint_writer

        os.makedirs(directory, exist_ok=True)
        self.sync_params()
        start_checkpoint_writer()  # its helper process must outlive a preemption signal
        dist_checkpointing.save(self.sharded_state_dict(), str(directory))

    def load_checkpoint(self, directory: str | os.PathLike, *, load_optimizer: bool = True) -> None:
        """Restore the model and, with ``load_optimizer``, the optimizer and scheduler (collective).

        ``load_optimizer=False`` reads only the model weights (:func:`load_model_weights`).
        """
        from megatron.core import dist_checkpointing

        if not load_optimizer:
            load_model_weights(self.model_chunks, directory)
            return
        _require_checkpoint_dir(directory)
        # torch's Adam (the CPU fallback) creates its state lazily, but megatron's loader
        # reads the existing state ('step'): materialise it with a zero update first (the
        # parameters it touches are overwritten by the load below).
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            if hasattr(opt, "_init_optimizer_states_with_dummy_values"):
                opt._init_optimizer_states_with_dummy_values()
        state = dist_checkpointing.load(self.sharded_state_dict(is_loading=True), str(directory))
        _load_model_state(self.model_chunks, state)
        # The fp32 optimizer state must be copied without autograd tracking.
        with torch.no_grad():
            self.optimizer.load_state_dict(state["optimizer"])
        _restore_torch_adam_steps(self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state[_SCHEDULER_KEY])


def model_sharded_state_dict(chunks: list) -> dict:
    """``{"model": ...}`` (one chunk) or ``{"model0": ..., "model1": ...}`` (virtual pipeline, megatron's naming)
    of bare model chunks; the sharded tensors inside carry global layer and expert indices, so the layout can change
    on load."""
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def _load_model_state(chunks: list, state: dict) -> None:
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    for key, chunk in zip(keys, chunks):
        chunk.load_state_dict(state[key])


def _require_checkpoint_dir(directory: str | os.PathLike) -> None:
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"policy checkpoint directory {directory} does not exist")


def load_model_weights(chunks: list, directory: str | os.PathLike) -> None:
    """Load the model weights of a policy checkpoint (``step_N/policy``) into bare model chunks (collective).

    The chunks may be built at another expert-parallel or virtual pipeline size than the checkpoint's, and in
    another dtype (values are cast on load: a bf16 checkpoint loads exactly into fp32 chunks). Nothing of the
    optimizer is read, so the chunks need no DDP wrapper or optimizer (``mcpo export`` loads its chunks so)."""
    from megatron.core import dist_checkpointing

    _require_checkpoint_dir(directory)
    state = dist_checkpointing.load(model_sharded_state_dict(chunks), str(directory))
    _load_model_state(chunks, state)


def _restore_torch_adam_steps(optimizer, optim_state: dict) -> None:
    """Give every parameter of torch's Adam (megatron's fallback without Apex/TE) the checkpoint's step.

    megatron-core keeps torch Adam's step count in the checkpoint's ``param_groups``, and its
    ``load_state_dict`` sets it, but the ``dp_reshardable`` parameter-state loader then copies each
    parameter's ``step`` from the placeholder state built for loading (the dummy value 1) over it.
    A wrong step changes Adam's bias correction, so a resumed run would diverge from an uninterrupted
    one from its first update on.
    """
    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    states = [optim_state] if len(opts) == 1 else [optim_state[i] for i in range(len(opts))]
    for opt, sd in zip(opts, states):
        inner = getattr(opt, "optimizer", None)
        groups = (sd.get("optimizer") or {}).get("param_groups", []) if isinstance(sd, dict) else []
        steps = {g["step"] for g in groups if g.get("step") is not None}
        if inner is None or not steps:
            continue  # Apex/TE FusedAdam keep the step in param_groups, which load correctly
        if len(steps) != 1:
            raise RuntimeError(f"checkpoint has inconsistent Adam steps {sorted(steps)} across param groups")
        step = float(steps.pop())
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state.get(p)
                if st is not None and "step" in st:
                    st["step"] = torch.tensor(step, dtype=torch.float32, device=st["step"].device)
