"""Passes of this rank's model chunks through megatron's pipeline schedule: micro-batching, the schedule call and
the log-prob pass, shared by the trainable :class:`~mcpo_megatron.models.policy.MegatronPolicy` and the frozen
:class:`~mcpo_megatron.models.reference.ReferencePolicy`.

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

Sequence packing (``sequence_packing``, :mod:`~mcpo_megatron.models.packing`): each micro-batch is one row of
whole sequences with megatron's THD ``PackedSeqParams``, built on every rank from the same batch, so every
pipeline stage (first, middle and last) gets the sequence boundaries its attention needs; the response side stays
[b, T] per sequence, so the loss and its denominators are those of the padded micro-batch.

Context parallelism (``info.cp`` > 1, packed micro-batches only): each CP rank runs its two chunks of every
sequence (:mod:`~mcpo_megatron.models.context_parallel`); its loss covers the response tokens it holds, the
metric sums add up over data x context parallel ranks, and log-probs are summed over the CP group (each rank has
0 where it does not hold a token).

Log-probs are computed on the last stage from the vocab-parallel logits (``GPTModel`` called without labels and
with ``parallel_output=True`` never gathers the vocabulary) of the response positions only: the output layer runs
on the final hidden states at those positions (:mod:`~mcpo_megatron.models.scored_positions`), and its
[b, T, V/tp] logits go to :func:`~mcpo_megatron.parallel.logprobs.vocab_parallel_logprobs`, which works in token
chunks with TP all-reduces.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial

import torch

from mcpo_megatron.models.batch import (
    MicroBatch,
    SequenceBatch,
    fixed_shape_microbatches,
    make_microbatches,
    pad_microbatch_count,
    unpad_response,
)
from mcpo_megatron.models.packing import pad_packed_count, packed_microbatches
from mcpo_megatron.models.context_parallel import split_for_cp_rank
from mcpo_megatron.models.scored_positions import ScoredOutputLayer
from mcpo_megatron.parallel.distributed import all_reduce_max, all_reduce_sum, broadcast


def set_schedule_options(chunks: list, pp: int) -> None:
    """Pipeline-schedule options of this rank's model chunks (see the module docstring)."""
    for model in chunks:
        # Set after construction: TransformerConfig's validation rejects variable_seq_lengths
        # with the (unused, MoE-only) default allgather token dispatcher.  The interleaved
        # schedule runs fixed shapes instead.
        model.config.variable_seq_lengths = len(chunks) == 1
        if len(chunks) > 1 and pp == 2:
            model.config.batch_p2p_comm = False


def check_context_parallel(info, sequence_packing: bool, who: str) -> None:
    """Context parallelism splits packed sequences only (the CPU's reference attention and this package's split
    read the packed layout)."""
    if info.cp > 1 and not sequence_packing:
        raise ValueError(f"{who}: context parallel size {info.cp} needs sequence_packing=True "
                         "(set trainer.sequence_packing=true)")


def _default_dtype() -> torch.dtype:
    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


def as_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    """The parameter dtype of a policy: a torch dtype, a config name, or None / "auto" (bf16 with CUDA, else fp32)."""
    if dtype is None:
        return _default_dtype()
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32,
             "float32": torch.float32, "auto": _default_dtype()}
    if dtype not in names:
        raise ValueError(f"dtype={dtype!r} must be one of {sorted(names)}")
    return names[dtype]


class PipelinePasses:
    """Forward passes of this rank's model chunks over a :class:`SequenceBatch`, and the log-prob pass.

    A base class: the subclass's constructor sets ``info`` (this rank's ``ParallelInfo``), ``ddps`` (one
    wrapped chunk per virtual pipeline stage: megatron's DDP, or a frozen stand-in with a ``module``),
    ``max_tokens_per_microbatch``, ``sequence_packing`` (micro-batches as packed bins,
    :mod:`~mcpo_megatron.models.packing`), ``logprob_chunk_size``, ``temperature``, ``vocab_size``, ``is_moe``
    and ``routing`` (the routing replay's hooks, :mod:`~mcpo_megatron.models.routing_replay`).
    """

    # ------------------------------------------------------------------ the chunks
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

    # ------------------------------------------------------------------ the log-prob pass
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
        flat = self._share_results(store[: len(mbs)], mbs, compute_entropy)
        return _per_sequence(flat, mbs, len(batch), compute_entropy)

    def _share_results(self, store: list[dict], mbs: list[MicroBatch], compute_entropy: bool) -> torch.Tensor:
        """The last stage's results as one flat fp32 buffer on every pipeline stage: [logp of every
        micro-batch..., entropy...], broadcast from the last stage on the training device (NCCL on GPUs)."""
        sizes = [mb.mask.numel() for mb in mbs]
        n_fields = 2 if compute_entropy else 1
        flat = torch.empty(n_fields * sum(sizes), dtype=torch.float32, device=self.info.device)
        if self.info.is_last_stage:
            parts = [out["logp"].reshape(-1) for out in store]
            if compute_entropy:
                parts += [out["entropy"].reshape(-1) for out in store]
            flat.copy_(torch.cat(parts))
        if self.info.pp > 1:
            broadcast(flat, src=self.info.pp - 1, group=self.info.pp_group)
        if self.info.cp > 1:  # each CP rank holds its own tokens' values and 0 elsewhere
            all_reduce_sum(flat, self.info.cp_group)
        return flat

    # ------------------------------------------------------------------ one pass
    def _microbatches(self, batch: SequenceBatch) -> list[MicroBatch]:
        """Token-budget micro-batches (packed bins with ``sequence_packing``); with a virtual pipeline, fixed-shape
        ones (module docstring); as many on every data-parallel rank as on the busiest one when expert parallelism
        spans them."""
        batch.check_token_ids(self.vocab_size)  # on the host: vocab_parallel_logprobs does not check device ids
        # Sequence parallelism splits the sequence over TP ranks.
        multiple = self.info.tp if self.config.sequence_parallel else 1
        fixed = len(self.ddps) > 1
        if self.sequence_packing:
            return [mb.to(self.info.device) for mb in self._packed_microbatches(batch, multiple, fixed)]
        if fixed:
            mbs = fixed_shape_microbatches(batch, self.max_tokens_per_microbatch, self.info.pp,
                                           seq_multiple=multiple)
        else:
            mbs = make_microbatches(batch, self.max_tokens_per_microbatch, seq_multiple=multiple)
        if self.info.ep > 1:
            mbs = pad_microbatch_count(mbs, self._busiest_dp_rank_count(len(mbs)), seq_multiple=multiple,
                                       fixed_shape=fixed)
        return [mb.to(self.info.device) for mb in mbs]

    def _packed_microbatches(self, batch: SequenceBatch, multiple: int, fixed: bool) -> list[MicroBatch]:
        """Packed bins; with context parallelism each sequence padded to a multiple of 2 x CP (and the row to one
        of 2 x CP x TP under sequence parallelism: every CP rank's share then splits over TP), then this CP
        rank's part of every bin (models/context_parallel)."""
        cp = self.info.cp
        seq_multiple, total_multiple = (1, multiple) if cp == 1 else (2 * cp, 2 * cp * multiple)
        mbs = packed_microbatches(batch, self.max_tokens_per_microbatch, seq_multiple=seq_multiple,
                                  total_multiple=total_multiple, fixed_shape=fixed,
                                  num_multiple=self.info.pp if fixed else 1)
        if self.info.ep > 1:
            mbs = pad_packed_count(mbs, self._busiest_dp_rank_count(len(mbs)), total_multiple=total_multiple,
                                   fixed_shape=fixed)
        return mbs if cp == 1 else [split_for_cp_rank(mb, cp, self.info.cp_rank) for mb in mbs]

    def _busiest_dp_rank_count(self, count: int) -> int:
        """The largest micro-batch count over the data-parallel group (collective).

        Every MoE layer's forward runs megatron's token all-to-all over the expert-parallel group, whose ranks
        are data-parallel peers that split their own shares by the token budget: a rank with fewer micro-batches
        would leave its peers waiting in the all-to-all.  The DP group holds every EP group of this rank's stage.
        One int64 on the training device (NCCL on GPUs), every DP rank calls it once per pass."""
        n = torch.tensor([count], dtype=torch.int64, device=self.info.device)
        all_reduce_max(n, self.info.dp_group)
        return int(n.item())

    def _score_response_positions_only(self) -> None:
        """Have the last stage's output layer compute logits at the response positions only
        (:mod:`~mcpo_megatron.models.scored_positions`); called once the subclass has built ``ddps``."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import ColumnParallelLinear

        last = [d for d in self.ddps if getattr(d.module, "post_process", False)]
        for d in last:
            layer = type(d.module.output_layer)
            if not issubclass(layer, ColumnParallelLinear):  # megatron-core 0.19 swaps in TE's head for MXFP8
                raise NotImplementedError(f"the output layer is {layer.__module__}.{layer.__name__}; the log-prob "
                                          "passes run megatron's ColumnParallelLinear on the response positions only")
        self._scored_outputs = {id(d): ScoredOutputLayer(d.module, ps.get_tensor_model_parallel_group())
                                for d in last}

    def _forward(self, model, mb: MicroBatch):
        """One chunk's forward of ``mb``; MoE routers get the padding mask (True on padding and fillers).  A packed
        micro-batch's sequence boundaries go to every pipeline stage: each stage's attention needs them.  On the
        last stage the output is [1, b*T, V/tp]: logits at the response positions only."""
        packed = {} if mb.packing is None else {"packed_seq_params": mb.packing.packed_seq_params()}
        scored = self._scored_outputs.get(id(model))
        with scored.scoring(mb.resp_index) if scored is not None else nullcontext():
            if not self.is_moe:
                return model(mb.input_ids, mb.position_ids, None, **packed)
            with self.routing.micro_batch(model, mb):
                return model(mb.input_ids, mb.position_ids, None, padding_mask=~mb.token_mask(), **packed)

    def _set_train(self, training: bool) -> None:
        for d in self.ddps:
            d.train(training)

    def _response_logprobs(self, logits: torch.Tensor, mb: MicroBatch, compute_entropy: bool):
        """[b, T] log-probs (and entropy) of ``mb``'s response tokens from their [1, b*T, V/tp] logits."""
        from megatron.core import parallel_state as ps

        from mcpo_megatron.parallel.logprobs import vocab_parallel_logprobs

        tp = self.info.tp
        b, t = mb.resp_index.shape
        if logits.dim() != 3 or tuple(logits.shape[:2]) != (1, b * t) or logits.shape[-1] * tp != self.vocab_size:
            raise RuntimeError(f"expected vocab-parallel logits of the response positions [1, {b}*{t}, "
                               f"{self.vocab_size}/{tp}], got {tuple(logits.shape)}")
        logp, entropy = vocab_parallel_logprobs(
            logits.view(b, t, -1),
            mb.targets,
            ps.get_tensor_model_parallel_group(),
            chunk_size=self.logprob_chunk_size,
            temperature=self.temperature,
            compute_entropy=compute_entropy,
            # The logits are the output layer's product (or megatron's copy of it), saved by no other backward:
            # their storage can take the gradient, saving one [b, T, V/tp] buffer.
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
            # Ignored with variable_seq_lengths (shapes travel with the activations); else every shape (megatron
            # divides it by CP: a CP rank's micro-batch holds 1 / CP of the sequence).
            seq_length=max(mb.seq_length for mb in mbs) * self.info.cp,
            micro_batch_size=max(len(mb.input_ids) for mb in mbs),
            forward_only=forward_only,
        )

    def _pp_last_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_pipeline_model_parallel_last_rank()


def _per_sequence(flat: torch.Tensor, mbs: list[MicroBatch], n_sequences: int, compute_entropy: bool):
    """(log-probs, entropies or None): the flat buffer of :meth:`PipelinePasses._share_results` split into
    per-sequence CPU tensors in batch order, padding removed."""
    fields: list[list[torch.Tensor | None]] = [[None] * n_sequences for _ in range(2 if compute_entropy else 1)]
    offset = 0
    for values in fields:
        for mb in mbs:
            n = mb.mask.numel()
            for i, v in zip(mb.indices, unpad_response(flat[offset : offset + n].view_as(mb.mask), mb)):
                values[i] = v.cpu()
            offset += n
    return fields[0], (fields[1] if compute_entropy else None)
