"""MoE routing replay: a pass of the trainer routes each token to experts chosen elsewhere.

A mixture-of-experts router picks the top-k experts of each token from its router logits.  When two experts'
logits nearly tie, numeric noise (another micro-batch shape, another kernel, the rollout engine's kernels)
flips the choice, and a flipped expert changes the token's log-prob by far more than the noise itself.
Replay fixes the choice and keeps everything else:

* R2 (``model.moe_routing_replay=r2``, GSPO paper, Zheng et al. 2025, section 5): the old-log-prob pass of a
  global step records, per token and MoE layer, the experts its routers chose
  (:attr:`~mcpo_megatron.models.batch.SequenceBatch.routing`); the update passes of that step route the same
  tokens to the same experts.
* R3 (``r3``, "Rollout Routing Replay", Ma et al. 2025, arXiv 2510.11370): the rollout engine returns the
  experts it chose while sampling, and every trainer pass (old log-probs and updates) routes to them.

Mechanism: megatron-core's ``TopKRouter`` calls ``router_replay.get_replay_topk(scores, topk, ...,
default_compute_topk)`` in place of its top-k when ``router_replay`` is set (megatron's own
``RouterReplay`` keeps one global target per layer; a pipeline schedule runs many micro-batches and model
chunks between a forward and its backward, so each router gets a :class:`_LayerReplay` here instead, which
is handed the slice of the record that belongs to the micro-batch and model chunk being run).  Like megatron's
``REPLAY_FORWARD``, the replayed indices select which scores are used, and the probabilities are still
computed from the current router logits of those experts (for Qwen3-MoE: the softmax over the k chosen
logits), so the gradient is the gradient with the choice held fixed and the router keeps learning through
its weights for the chosen experts.

Token order: a router sees [S_local * b] tokens, sequence-major (megatron flattens [S, b, h]); with sequence
parallelism S_local = S / TP and TP rank r holds positions [r S_local, (r + 1) S_local).  Records are kept per
sequence ([n, num_layers, k], -1 where unknown), so later passes may cut the batch into other micro-batches,
pad it differently or run another sequence-parallel split.  A token whose record holds a -1 in a layer (padding,
a position the engine never ran, a layer of another pipeline stage) keeps its own choice there.

Reported (``moe/routing_mismatch_frac``): over the real tokens of a pass that replays and every MoE layer, the
fraction of (token, layer) decisions whose top-k expert SET computed by the pass itself differs from the
recorded one, i.e. what replay changed (R2: old-log-prob pass vs update pass; R3: engine vs trainer).

No host sync in a layer: the record stays in host memory and a model chunk's layers of it reach the device in one
copy per micro-batch, from pinned memory on GPUs (:func:`to_device`); the mismatch is counted on the device and
read once, when the pass ends; recording brings a micro-batch's choices back in one copy.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from mcpo_megatron.parallel.distributed import all_gather, all_reduce_sum

MODES = ("off", "r2", "r3")


# R3: samples per transfer when the trainer fetches the engine's routing of its share (trainer.step_data.
# fetch_routing); bounds what a rank receives at once (at 22k tokens, 48 layers, top-8 int16: about 1 GiB).
FETCH_CHUNK = 64


def record_dtype(num_experts: int) -> torch.dtype:
    """The smallest signed integer type for expert indices and -1 (int16 up to 32767 experts)."""
    return torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device`` in one copy that the host does not wait for: to a GPU, from pinned memory with
    ``non_blocking`` (asynchronous with respect to the host only from pinned memory, ``torch/_tensor_docs.py``
    1339-1341; a blocking copy waits for it, and so for the work queued before it). The pinned block is not
    handed out again before the copy has run (torch records the copy on it:
    ``torch/include/ATen/cuda/CachingHostAllocator.h`` 18-21, 29-30)."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def topk_set_mismatch(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[N] bool: the top-k index sets of rows of ``a`` and ``b`` ([N, k]) differ (order within a row ignored)."""
    return (a.sort(dim=-1).values != b.sort(dim=-1).values).any(dim=-1)


class _LayerReplay:
    """The replay hook of one ``TopKRouter`` (megatron's ``router_replay`` interface)."""

    def __init__(self, owner: "RoutingReplay", router) -> None:
        self.owner, self.router = owner, router
        self.target: torch.Tensor | None = None  # [S_local * b, k] long, -1 rows unknown
        self.valid: torch.Tensor | None = None   # [S_local * b] bool: real tokens
        self.recorded: torch.Tensor | None = None
        # Full activation recomputation runs a layer twice: without gradients in the forward pass, then again
        # in the backward pass, after other micro-batches ran; the second run takes the first run's target.
        self.pending: list[tuple] = []

    @property
    def layer(self) -> int:
        return self.router.layer_number - 1

    def _current(self) -> tuple:
        checkpointed = self.router.training and self.router.config.recompute_granularity == "full"
        if checkpointed and torch.is_grad_enabled():  # the recomputation (megatron's backward pass, FIFO)
            target, valid, _ = self.pending.pop(0)
            return target, valid, False
        if checkpointed:
            self.pending.append((self.target, self.valid, False))
        return self.target, self.valid, True

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        """megatron's top-k (``default_compute_topk``), or the recorded experts' scores where known."""
        values, chosen = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        target, valid, first_run = self._current()
        if self.owner.recording and first_run:
            self.recorded = chosen.detach()
        if target is None:
            return values, chosen
        known = (target >= 0).all(dim=-1)
        if first_run:
            self.owner.count(topk_set_mismatch(chosen, target.clamp(min=0)), valid & known)
        if not self.owner.apply:
            return values, chosen
        replayed = torch.where(known[:, None], target, chosen)
        return scores.gather(1, replayed), replayed


class RoutingReplay:
    """Records and replays the routing of every MoE router of ``model_chunks`` (module docstring).

    Args:
        model_chunks: bare ``GPTModel`` chunks of this rank.
        num_layers, num_experts, topk: the model's.
        record: R2: a log-prob pass over a batch without a routing record records one into it.
        sequence_parallel: tokens are split over TP inside the MoE layers.
        tp_group: the tensor-parallel group; ``count_groups``: the groups whose ranks hold other tokens or
            layers (data- and pipeline-parallel), summed over for the metric.
    """

    def __init__(self, model_chunks, *, num_layers: int, num_experts: int, topk: int, record: bool,
                 sequence_parallel: bool = False, tp_group=None, count_groups=()) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.num_layers, self.topk, self.dtype = num_layers, topk, record_dtype(num_experts)
        self.record = record
        self.sequence_parallel = sequence_parallel and tp_group is not None and dist.get_world_size(tp_group) > 1
        self.tp_group, self.count_groups = tp_group, [g for g in count_groups if g is not None]
        self.apply = True  # False: measure the mismatch only (``mcpo check-rollout``'s figures without replay)
        self.recording = False
        self._record: list[torch.Tensor] | None = None
        self._counts: torch.Tensor | None = None  # float64 [mismatched, decisions] on the device, this pass
        self.last_metrics: dict[str, float] = {}
        for chunk in model_chunks:
            for m in chunk.modules():
                if isinstance(m, TopKRouter):
                    if m.config.moe_router_fusion or m.routing_type == "sinkhorn":
                        raise ValueError("model.moe_routing_replay needs megatron's unfused top-k router "
                                         "(moe_router_fusion off, routing type not sinkhorn)")
                    m.router_replay = _LayerReplay(self, m)

    # ------------------------------------------------------------------ one pass
    def begin(self, batch, *, may_record: bool) -> None:
        """Start a pass over ``batch``; with R2 and ``may_record``, record its routing when it has none."""
        self.recording = self.record and may_record and batch.routing is None
        self._record = None
        if self.recording:
            self._record = [torch.full((len(ids), self.num_layers, self.topk), -1, dtype=self.dtype)
                            for ids in batch.input_ids]
        self._counts = None

    def finish(self, batch) -> dict[str, float]:
        """End the pass (a collective): attach a new record to ``batch``; ``moe/routing_mismatch_frac``
        when the pass replayed anywhere."""
        if self.recording:
            batch.routing = self._record
        self.recording, self._record = False, None
        counts = torch.zeros(2, dtype=torch.float64) if self._counts is None else self._counts.cpu()
        self._counts = None
        for group in ([self.tp_group] if self.sequence_parallel else []) + self.count_groups:
            all_reduce_sum(counts, group)  # CPU float64 (gloo with the default backend map)
        mismatched, decisions = counts.tolist()
        self.last_metrics = {"moe/routing_mismatch_frac": mismatched / decisions} if decisions > 0 else {}
        return dict(self.last_metrics)

    def count(self, mismatched: torch.Tensor, valid: torch.Tensor) -> None:
        """Add one layer's mismatched and real (token, layer) decisions to the pass's counts, on the device."""
        pair = torch.stack([(mismatched & valid).sum(), valid.sum()]).to(torch.float64)
        self._counts = pair if self._counts is None else self._counts + pair

    @contextmanager
    def micro_batch(self, model, mb):
        """Around one model chunk's forward of ``mb``: its routers replay ``mb.routing`` (and record)."""
        layers = [m.router_replay for m in model.modules() if isinstance(getattr(m, "router_replay", None),
                                                                          _LayerReplay)]
        valid = self._local(mb.token_mask().transpose(0, 1)).reshape(-1)
        targets = self._targets(mb, [layer.layer for layer in layers], valid.device)
        for layer, target in zip(layers, targets):
            layer.valid, layer.target = valid, target
        try:
            yield
            if self.recording and not mb.filler:
                self._store([layer.layer for layer in layers], [layer.recorded for layer in layers], mb)
        finally:
            for layer in layers:
                layer.target = layer.valid = layer.recorded = None

    def _targets(self, mb, layer_ids: list[int], device: torch.device) -> list[torch.Tensor | None]:
        """The [S_local * b, k] long target of each of ``layer_ids`` for ``mb`` (None where ``mb`` replays
        nothing), from one host-to-device copy of those layers of its record."""
        if mb.routing is None or mb.filler or not layer_ids:
            return [None] * len(layer_ids)
        host = self._local(mb.routing.transpose(0, 1))[:, :, layer_ids]  # [S_local, b, layers, k], host memory
        on_device = to_device(host, device).long()
        return [on_device[:, :, i].reshape(-1, on_device.shape[-1]) for i in range(len(layer_ids))]

    def _local(self, seq_major: torch.Tensor) -> torch.Tensor:
        """This TP rank's slice of an [S, b, ...] tensor (sequence parallelism), else the whole tensor."""
        if not self.sequence_parallel:
            return seq_major
        tp, rank = dist.get_world_size(self.tp_group), dist.get_rank(self.tp_group)
        s_local = seq_major.shape[0] // tp
        return seq_major[rank * s_local:(rank + 1) * s_local]

    def _store(self, layer_ids: list[int], recorded: list[torch.Tensor], mb) -> None:
        """Write the [S_local * b, k] choices of ``mb`` that the routers of ``layer_ids`` made into the
        per-sequence record: one all-gather over TP (sequence parallelism) and one device-to-host copy for them all."""
        if not layer_ids:
            return
        b, s = mb.input_ids.shape
        stacked = torch.stack(recorded)  # [layers, S_local * b, k] int64 on the training device
        if self.sequence_parallel:
            # every TP rank of the group runs this forward in step
            stacked = torch.cat(all_gather(stacked.contiguous(), self.tp_group), dim=1)
        host = stacked.to(self.dtype).cpu()  # the host waits for the forward here, once per micro-batch
        per_row = host.view(len(layer_ids), s, b, -1).permute(2, 1, 0, 3)  # [b, S, layers, k]
        for row, i in enumerate(mb.indices):
            n = self._record[i].shape[0]
            self._record[i][:, layer_ids] = per_row[row, :n]


class NoReplay:
    """Stands in for :class:`RoutingReplay` when replay is off or the model has no experts."""

    last_metrics: dict[str, float] = {}

    def begin(self, batch, *, may_record: bool) -> None:
        pass

    def finish(self, batch) -> dict[str, float]:
        return {}

    @contextmanager
    def micro_batch(self, model, mb):
        yield


def attach_routing_replay(model_chunks, shape, mode: str, info, *, sequence_parallel: bool):
    """``model.moe_routing_replay``'s hooks on this rank's routers (:class:`NoReplay` for off or dense)."""
    if mode not in MODES:
        raise ValueError(f"model.moe_routing_replay={mode!r} must be one of {', '.join(MODES)}")
    if mode == "off":
        return NoReplay()
    if not shape.is_moe:
        raise ValueError(f"model.moe_routing_replay={mode} needs a mixture-of-experts model; this one has no experts")
    from megatron.core import parallel_state as ps

    return RoutingReplay(model_chunks, num_layers=shape.num_layers, num_experts=shape.num_experts,
                         topk=shape.moe_topk, record=mode == "r2", sequence_parallel=sequence_parallel,
                         tp_group=ps.get_tensor_model_parallel_group(), count_groups=(info.dp_group, info.pp_group))
