"""The trainable policy: a Hugging Face model on Megatron TP x PP x DP, with the loss on device.

``MegatronPolicy`` builds this rank's pipeline stage with
:func:`~mcpo_megatron.models.builder.build_gpt_model`, loads the Hugging Face weights
into its TP/PP slices, wraps it in megatron-core's ``DistributedDataParallel`` and builds
megatron's (distributed) Adam optimizer and LR scheduler.  Two calls do the work:

* :meth:`MegatronPolicy.compute_logprobs` - forward only; per-sequence log-probs and
  entropy of the response tokens, on every rank of the DP group that was given the batch.
* :meth:`MegatronPolicy.train_step` - forward-backward with the caller's loss, then one
  optimizer step.

How batches become micro-batches and pass through megatron's pipeline schedule (variable sequence lengths,
interleaved pipelines, experts, vocab-parallel log-probs) is :mod:`~mcpo_megatron.models.passes`, the base class;
the checkpoint is :mod:`~mcpo_megatron.models.policy_checkpoint`.

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

from mcpo_megatron.models.batch import MicroBatch, SequenceBatch
from mcpo_megatron.models.optim import build_optimizer, build_scheduler
from mcpo_megatron.models.passes import PipelinePasses, check_context_parallel, set_schedule_options
from mcpo_megatron.models.policy_checkpoint import (
    load_model_weights,
    load_state,
    model_sharded_state_dict,
    save_state,
    sharded_state_dict,
)
from mcpo_megatron.models.policy_settings import PolicySettings
from mcpo_megatron.parallel.distributed import all_reduce_max, all_reduce_sum

# The module's public names, some defined in passes.py and policy_checkpoint.py.
__all__ = ["MegatronPolicy", "LossFn", "load_model_weights", "model_sharded_state_dict", "set_schedule_options"]

LossFn = Callable[[torch.Tensor, torch.Tensor | None, MicroBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]]

# model.recompute_activations: what mcpo plan's activation estimate assumes.
_RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def grads_finite(buffers: list[torch.Tensor], groups: list, device: torch.device) -> bool:
    """True when every rank's gradient ``buffers`` are finite: one flag on ``device`` (the training device) over
    all of them, one MAX all-reduce of it over each of ``groups``, one host read.

    Checked on the whole local buffers before the optimizer step, after the data-parallel reduction: a non-finite
    local gradient reaches its owner's shard in that reduction, so checking every rank's full buffers covers every
    parameter. A buffer's largest magnitude is finite exactly when all of it is (NaN and Inf survive a max), and a
    norm's reduction needs no buffer-sized temporary.
    """
    bad = torch.zeros(1, dtype=torch.float32, device=device)
    if buffers:
        peaks = torch.stack([torch.linalg.vector_norm(b, ord=math.inf).float() for b in buffers])
        bad = torch.isfinite(peaks).all().logical_not().float().reshape(1)
    for group in groups:
        all_reduce_max(bad, group)  # float32 on the training device: NCCL on GPUs
    return bad.item() == 0.0


def grad_stats_groups(optimizer) -> list:
    """The groups megatron-core reduces its gradient statistics over, one per distinct group of ``optimizer``'s
    parts (``get_grad_stats_parallel_group``: 0.16.1 ``optimizer/optimizer.py`` 164-182 and
    ``distrib_optimizer.py`` 620-626, set by ``optimizer/__init__.py`` 446-466). With the distributed optimizer it is
    the optimizer instance's group, which spans the world and carries megatron's grad-norm all-reduce every step
    (``optimizer/clip_grads.py`` 97 and 131): a non-finite check over it opens no communicator of its own. Without it,
    the model-parallel group (DP replicas hold the same reduced gradients) and for MoE the experts' one too."""
    groups: list = []
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        group = part.get_grad_stats_parallel_group()
        if all(group is not g for g in groups):
            groups.append(group)
    return groups


def _finalize_grads_as_sum(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
    """megatron's ``finalize_model_grads`` without the division by the global token count.

    The policy loss is already normalised by global counts (per-token weights), so the
    gradient wanted is that of the plain sum; DDP sums over DP because
    ``calculate_per_token_loss`` is on.
    """
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
    sum_head_norm_grads(model)


def sum_head_norm_grads(model) -> None:
    """Sum over TP the gradient of a norm that each TP rank applies to its own heads (``partial_over_tp``: a
    Gated DeltaNet's gated ``out_norm``, one weight shared by all value heads, which megatron splits over TP).
    megatron's ``finalize_model_grads`` sums such a gradient only under sequence parallelism, through the
    parameter's ``sequence_parallel`` attribute (distributed/finalize_model_grads.py:354 of 0.16.1, 452 of 0.19.2);
    without it, each rank would keep the part of its own heads. One fp32 all-reduce of the flattened
    ``main_grad``s over the TP group, on the training device; every rank of the group holds the same such
    parameters, in the same order (the same stage). Elementwise, so with the distributed optimizer the shard a
    rank owns is right, as for megatron's own sums."""
    from megatron.core import parallel_state as ps
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    group = ps.get_tensor_model_parallel_group()
    if ps.get_tensor_model_parallel_world_size() == 1:
        return
    params = [p for chunk in model for p in chunk.parameters()
              if p.requires_grad and getattr(p, "partial_over_tp", False)
              and not (chunk.config.sequence_parallel and getattr(p, "sequence_parallel", False))]
    if not params:
        return
    grads = [p.main_grad.data for p in params]
    flat = all_reduce_sum(_flatten_dense_tensors(grads), group)
    for g, summed in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(summed)


class MegatronPolicy(PipelinePasses):
    """A Megatron ``GPTModel`` stage + DDP + distributed optimizer + LR schedule.

    Args:
        hf_dir: Hugging Face model directory (config.json + safetensors).
        settings: how it computes and steps (:class:`~mcpo_megatron.models.policy_settings.PolicySettings`,
            checked when made); None: the defaults.
        parallel_info: this rank's layout (``init_distributed``); read from megatron's
            ``parallel_state`` when None.
        hf_config: an already loaded HF config (skips reading ``hf_dir/config.json``).
        load_weights: load the HF weights (False keeps megatron's random init; for benchmarks and for a model
            a checkpoint is loaded into).
    """

    def __init__(self, hf_dir: str | os.PathLike | None, settings: PolicySettings | None = None, *,
                 parallel_info=None, hf_config: Any = None, load_weights: bool = True) -> None:
        from mcpo_megatron.parallel.distributed import parallel_info as _parallel_info

        s = self.settings = settings if settings is not None else PolicySettings()
        self.info = parallel_info if parallel_info is not None else _parallel_info()
        self.dtype = s.dtype
        self.sequence_packing = s.sequence_packing
        self.optim_settings = s.optim
        check_context_parallel(self.info, self.sequence_packing, "MegatronPolicy")
        self.max_tokens_per_microbatch = s.max_tokens_per_microbatch
        self.logprob_chunk_size = s.logprob_chunk_size
        self.temperature = float(s.temperature)
        self.hf_dir = None if hf_dir is None else str(hf_dir)
        self.hf_config = hf_config if hf_config is not None else self._read_hf_config()

        chunks = self._build_chunks(s.transformer_impl, s.sequence_parallel, s.recompute_activations, load_weights)
        shape = chunks[0].mcpo_shape
        self.vocab_size = int(shape.vocab_size)
        self.is_moe = bool(shape.is_moe)
        if self.is_moe and self.info.cp > 1:
            raise ValueError(f"MegatronPolicy: a mixture-of-experts model with context parallel size {self.info.cp} "
                             "is not supported (its load report sums over data-parallel ranks only); use "
                             "parallelism.context_parallel_size=1")
        self.overlap_param_gather = s.overlap_param_gather
        self._params_stale = False  # a step's all-gather is still pending (overlap_param_gather)
        self._wrap_for_training(chunks, overlap_grad_reduce=s.overlap_grad_reduce)
        self.moe_monitor = self._load_balance_monitor(chunks, shape, s.moe_aux_loss_coeff) if shape.is_moe else None
        from mcpo_megatron.models.routing_replay import attach_routing_replay

        self.routing = attach_routing_replay(chunks, shape, s.moe_routing_replay, self.info,
                                             sequence_parallel=self.config.sequence_parallel)

    def _read_hf_config(self):
        if self.hf_dir is None:
            raise ValueError("MegatronPolicy needs hf_dir or hf_config")
        from mcpo_megatron.models.multimodal import load_language_model_config

        return load_language_model_config(self.hf_dir)

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
        self._score_response_positions_only()
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
            chunks, shape, coeff=coeff, sequence_parallel=self.config.sequence_parallel,
            tp_group=ps.get_tensor_model_parallel_group(), dp_group=self.info.dp_group,
            pp_group=self.info.pp_group, device=self.info.device)

    # ------------------------------------------------------------------ the loss pass
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
            # A CPU scalar (gloo with the default backend map), read from the device once.
            real = torch.stack([mb.token_mask().sum() for mb in mbs]).sum().to("cpu", torch.float64).reshape(1)
            all_reduce_sum(real, self.info.data_group)
            self.moe_monitor.begin(int(real.item()))
        self.routing.begin(batch, may_record=False)

        def loss_func(mb: MicroBatch, logits: torch.Tensor):
            if mb.filler:  # no loss; a zero that still reaches every parameter through the graph
                zero = torch.tensor(0, dtype=torch.int, device=logits.device)
                return logits.sum() * 0.0, zero, {}
            logp, ent = self._response_logprobs(logits, mb, True)
            loss, metric_sums = loss_fn(logp, ent, mb)
            reduced = {"loss": loss.detach().float().reshape(())}
            if mb.counted_rows is not None and "seqs" in metric_sums:  # a sequence split over CP ranks counts once
                metric_sums["seqs"] = (mb.counted_rows & (mb.response_lens > 0)).sum()
            for k, v in metric_sums.items():
                reduced[k] = torch.as_tensor(v).detach().float().reshape(()).to(loss.device)
            # 3-tuple + calculate_per_token_loss: the schedule neither divides by the
            # token count nor by the number of micro-batches (see module docstring).
            n_tok = mb.mask.sum(dtype=torch.int)  # on the device: no host read between forward and backward
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
            # counted once per data-parallel rank (the ranks of a CP group run the same micro-batches)
            counts = [num_microbatches, num_fillers] if self.info.cp_rank == 0 else [0, 0]
            values[-2:] = torch.tensor(counts, dtype=torch.float64)
            all_reduce_sum(values, self.info.data_group)  # on the training device
            payload = (keys, values.cpu().tolist())
        else:
            payload = None
        if self.info.pp > 1:
            payload = broadcast_object(payload, src=self._pp_last_rank(), group=self.info.pp_group)
        keys, vals = payload
        out = {k: float(v) for k, v in zip(keys, vals[:-2])}
        out["num_microbatches"], out["num_filler_microbatches"] = int(vals[-2]), int(vals[-1])
        return out

    # ------------------------------------------------------------------ the optimizer step
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
        """True when every rank's gradient buffers are finite (:func:`grads_finite`)."""
        buffers = [b.grad_data for d in self.ddps for b in d.buffers + d.expert_parallel_buffers]
        return grads_finite(buffers, grad_stats_groups(self.optimizer), self.info.device)

    # ------------------------------------------------------------------ checkpoints (models/policy_checkpoint)
    def sharded_state_dict(self, *, is_loading: bool = False) -> dict:
        """Model (from the bare chunks), optimizer (dp-reshardable) and scheduler state."""
        return sharded_state_dict(self.model_chunks, self.optimizer, self.scheduler, is_loading=is_loading)

    def save_checkpoint(self, directory: str | os.PathLike) -> None:
        """Write this policy's state into ``directory`` (collective; every rank calls it).

        The caller owns atomicity (write into a temporary directory, then rename).
        """
        self.sync_params()
        save_state(self.model_chunks, self.optimizer, self.scheduler, directory)

    def load_checkpoint(self, directory: str | os.PathLike, *, load_optimizer: bool = True) -> None:
        """Restore the model and, with ``load_optimizer``, the optimizer and scheduler (collective).

        ``load_optimizer=False`` reads only the model weights (:func:`load_model_weights`).
        """
        if not load_optimizer:
            load_model_weights(self.model_chunks, directory)
            return
        load_state(self.model_chunks, self.optimizer, self.scheduler, directory)
