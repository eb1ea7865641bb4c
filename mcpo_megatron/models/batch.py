"""The trainer <-> policy batch contract and its token-budget micro-batches.

``SequenceBatch`` is what the trainer hands to :class:`~mcpo_megatron.models.policy.MegatronPolicy`:
ragged per-sequence tensors.  The policy cuts it into :class:`MicroBatch` es with
:func:`split_by_token_budget` and pads each one on its own, so a micro-batch of short
sequences does not pay for the longest sequence of the mini-batch.

Token position convention: the log-prob of response token ``j`` (0-based) is predicted
from the logits at position ``prompt_len + j - 1`` of the full sequence.  Sequences are
right-padded, so with a causal mask the padding never influences a real position and no
attention mask is needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mcpo_megatron.models.packed_layout import PackedLayout


@dataclass
class SequenceBatch:
    """Per-sequence inputs of one policy call (one DP rank's share of a mini-batch).

    Attributes:
        input_ids: per sequence, 1-D long: prompt tokens followed by response tokens.
        prompt_lens: [B] long.
        response_lens: [B] long (may be 0).
        token_fields: per sequence, 1-D float of length response_len, e.g. "old_logp",
            "rollout_logp", "ref_logp", "advantages", "pg_weight", "hkl_weight".
        seq_fields: [B] per-sequence values, e.g. "mastered", "advantage".
        routing: MoE routing replay (:mod:`~mcpo_megatron.models.routing_replay`): per sequence, an integer
            [n, num_layers, top-k] tensor of the experts each of its first n <= prompt_len + response_len
            tokens was routed to in every layer (-1 where a layer's choice is not known); None: no replay.
    """

    input_ids: list[torch.Tensor]
    prompt_lens: torch.Tensor
    response_lens: torch.Tensor
    token_fields: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    seq_fields: dict[str, torch.Tensor] = field(default_factory=dict)
    routing: list[torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.input_ids)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field, the sequence and the rule that is broken."""
        n = len(self.input_ids)
        if n == 0:
            raise ValueError("SequenceBatch.input_ids is empty; give every DP rank at least one sequence")
        for name in ("prompt_lens", "response_lens"):
            t = getattr(self, name)
            if t.dim() != 1 or t.numel() != n:
                raise ValueError(
                    f"SequenceBatch.{name} has shape {tuple(t.shape)}; it must be [{n}] "
                    "(one entry per sequence in input_ids)"
                )
        for i, ids in enumerate(self.input_ids):
            p, r = int(self.prompt_lens[i]), int(self.response_lens[i])
            if ids.dim() != 1 or ids.numel() != p + r:
                raise ValueError(
                    f"SequenceBatch.input_ids[{i}] has shape {tuple(ids.shape)}; it must be 1-D with "
                    f"prompt_len + response_len = {p} + {r} tokens"
                )
            if r > 0 and p < 1:
                raise ValueError(
                    f"SequenceBatch.prompt_lens[{i}] = {p}; a sequence with a response needs at least "
                    "one prompt token (response token 0 is predicted from position prompt_len - 1)"
                )
        for key, values in self.token_fields.items():
            if len(values) != n:
                raise ValueError(f"SequenceBatch.token_fields[{key!r}] has {len(values)} entries; expected {n}")
            for i, v in enumerate(values):
                if v.numel() != int(self.response_lens[i]):
                    raise ValueError(
                        f"SequenceBatch.token_fields[{key!r}][{i}] has {v.numel()} values; it must have "
                        f"response_len = {int(self.response_lens[i])}"
                    )
        for key, v in self.seq_fields.items():
            if v.shape[:1] != (n,):
                raise ValueError(f"SequenceBatch.seq_fields[{key!r}] has shape {tuple(v.shape)}; expected [{n}, ...]")
        if self.routing is not None:
            if len(self.routing) != n:
                raise ValueError(f"SequenceBatch.routing has {len(self.routing)} entries; expected {n}")
            for i, r in enumerate(self.routing):
                total = int(self.prompt_lens[i]) + int(self.response_lens[i])
                if r.dim() != 3 or r.shape[0] > total or r.is_floating_point():
                    raise ValueError(
                        f"SequenceBatch.routing[{i}] has shape {tuple(r.shape)} ({r.dtype}); it must be an integer "
                        f"[n, num_layers, top-k] tensor with n <= prompt_len + response_len = {total}")

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise ``ValueError`` when a token id lies outside ``[0, vocab_size)``: the embedding and the log-prob
        targets index the vocabulary with them. Checked on the host, before the ids reach the device, where the
        check waits for nothing."""
        ids = torch.cat([t.reshape(-1) for t in self.input_ids])
        if ids.numel() == 0:
            return
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"SequenceBatch.input_ids span [{lo}, {hi}] but the model's vocabulary has {vocab_size} "
                             "entries; check the tokenizer / the model the rollouts were generated with")

    def seq_lens(self) -> torch.Tensor:
        """[B] long total lengths (prompt + response)."""
        return self.prompt_lens.long() + self.response_lens.long()


@dataclass
class MicroBatch:
    """Padded tensors of one micro-batch (b sequences, S positions, T response tokens).

    Attributes:
        indices: positions of these sequences in the parent ``SequenceBatch``.
        input_ids: [b, S] long, right-padded with ``pad_id``.
        position_ids: [b, S] long, 0..S-1 on every row.
        resp_index: [b, T] long: the position whose logits predict response token j
            (``prompt_len + j - 1``); 0 on padding.
        targets: [b, T] long: the response token ids; 0 on padding.
        mask: [b, T] bool: True on real response tokens.
        token_fields: [b, T] float each, 0 on padding.
        seq_fields: [b, ...] each.
        prompt_lens, response_lens: [b] long.
        routing: [b, S, num_layers, top-k] integer expert indices to replay (SequenceBatch.routing padded with
            -1, "not known"), or None.
        packing: None for a padded micro-batch; for a packed one (:mod:`~mcpo_megatron.models.packing`) where
            its sequences sit in its single row: ``input_ids`` and ``position_ids`` are then [1, S] and
            ``resp_index`` points into that row.
    """

    indices: list[int]
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    resp_index: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    token_fields: dict[str, torch.Tensor]
    seq_fields: dict[str, torch.Tensor]
    prompt_lens: torch.Tensor
    response_lens: torch.Tensor
    filler: bool = False  # a stand-in that only completes a pipeline schedule (no loss, no results)
    routing: torch.Tensor | None = None
    packing: "PackedLayout | None" = None
    # context parallelism: [b] True on the rows whose sequence this rank counts (it holds their first response
    # token); None: every row (models/context_parallel)
    counted_rows: torch.Tensor | None = None

    @property
    def seq_length(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_response_tokens(self) -> int:
        return int(self.mask.sum())

    def token_mask(self) -> torch.Tensor:
        """[b, S] bool ([1, S] packed): True on real (prompt or response) tokens, False on padding and in
        fillers."""
        if self.packing is not None:
            return self.packing.token_mask & (not self.filler)
        lens = self.prompt_lens + self.response_lens
        mask = torch.arange(self.seq_length, device=lens.device)[None, :] < lens[:, None]
        return mask & (not self.filler)

    def to(self, device) -> "MicroBatch":
        """A copy with every tensor on ``device``."""
        mv = lambda t: t.to(device)  # noqa: E731
        return MicroBatch(
            indices=list(self.indices),
            input_ids=mv(self.input_ids),
            position_ids=mv(self.position_ids),
            resp_index=mv(self.resp_index),
            targets=mv(self.targets),
            mask=mv(self.mask),
            token_fields={k: mv(v) for k, v in self.token_fields.items()},
            seq_fields={k: mv(v) for k, v in self.seq_fields.items()},
            prompt_lens=mv(self.prompt_lens),
            response_lens=mv(self.response_lens),
            filler=self.filler,
            routing=self.routing,  # stays in host memory: the replay moves a chunk's layers of it per micro-batch
            packing=None if self.packing is None else self.packing.to(device),
            counted_rows=None if self.counted_rows is None else self.counted_rows.to(device),
        )


def pad_to_multiple(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``n`` (sequence parallelism needs S % TP == 0)."""
    if multiple < 1:
        raise ValueError(f"pad_to_multiple: multiple={multiple!r} must be a positive integer")
    return -(-n // multiple) * multiple


def split_by_token_budget(batch_or_lengths, max_tokens: int) -> list[list[int]]:
    """Group sequence indices into micro-batches whose padded size b * S_max fits ``max_tokens``.

    Sequences are sorted by length, longest first (ties by index, so the split is
    deterministic), and filled greedily: a sequence joins the current group while
    ``(b + 1) * S_max <= max_tokens``, where S_max is the group's first (longest) length.
    A sequence longer than the budget forms a micro-batch of its own.

    Args:
        batch_or_lengths: a :class:`SequenceBatch` or a 1-D sequence of total lengths.
        max_tokens: padded-token budget per micro-batch.

    Returns:
        Lists of indices into the batch, one list per micro-batch.
    """
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(
            f"max_tokens_per_microbatch={max_tokens!r} must be a positive integer (padded tokens per micro-batch)"
        )
    if isinstance(batch_or_lengths, SequenceBatch):
        lengths = [int(x) for x in batch_or_lengths.seq_lens()]
    else:
        lengths = [int(x) for x in batch_or_lengths]
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    current: list[int] = []
    s_max = 0
    for i in order:
        if current and (len(current) + 1) * s_max <= max_tokens:
            current.append(i)
            continue
        if current:
            groups.append(current)
        current, s_max = [i], max(lengths[i], 1)
    if current:
        groups.append(current)
    return groups


def make_microbatch(
    batch: SequenceBatch, indices: list[int], *, pad_id: int = 0, seq_multiple: int = 1
) -> MicroBatch:
    """Pad the sequences ``indices`` of ``batch`` into a :class:`MicroBatch`.

    ``seq_multiple`` rounds the padded length S up (sequence parallelism needs S % TP == 0).
    T is at least 1 so that every micro-batch has a response axis even when all responses
    are empty (then ``mask`` is all False).
    """
    b = len(indices)
    p_lens = batch.prompt_lens[indices].long()
    r_lens = batch.response_lens[indices].long()
    s = pad_to_multiple(max(int((p_lens + r_lens).max()), 1), seq_multiple)
    t = max(int(r_lens.max()), 1)
    input_ids = torch.full((b, s), pad_id, dtype=torch.long)
    resp_index = torch.zeros((b, t), dtype=torch.long)
    targets = torch.zeros((b, t), dtype=torch.long)
    mask = torch.zeros((b, t), dtype=torch.bool)
    fields = {
        k: torch.zeros((b, t), dtype=v[indices[0]].dtype if v[indices[0]].is_floating_point() else torch.float32)
        for k, v in batch.token_fields.items()
    }
    for row, i in enumerate(indices):
        ids = batch.input_ids[i].long()
        p, r = int(p_lens[row]), int(r_lens[row])
        input_ids[row, : p + r] = ids
        if r > 0:
            resp_index[row, :r] = torch.arange(p - 1, p + r - 1)
            targets[row, :r] = ids[p : p + r]
            mask[row, :r] = True
            for k, v in batch.token_fields.items():
                fields[k][row, :r] = v[i].to(fields[k].dtype)
    position_ids = torch.arange(s, dtype=torch.long).unsqueeze(0).expand(b, s).contiguous()
    idx = torch.as_tensor(indices, dtype=torch.long)
    routing = None
    known = [] if batch.routing is None else [batch.routing[i] for i in indices if batch.routing[i].numel()]
    if known:  # sequences without a record (none of their tokens known) keep -1
        routing = torch.full((b, s) + tuple(known[0].shape[1:]), -1, dtype=known[0].dtype)
        for row, i in enumerate(indices):
            if batch.routing[i].numel():
                routing[row, : batch.routing[i].shape[0]] = batch.routing[i]
    return MicroBatch(
        indices=list(indices),
        input_ids=input_ids,
        position_ids=position_ids,
        resp_index=resp_index,
        targets=targets,
        mask=mask,
        token_fields=fields,
        seq_fields={k: v[idx] for k, v in batch.seq_fields.items()},
        prompt_lens=p_lens,
        response_lens=r_lens,
        routing=routing,
    )


def make_microbatches(
    batch: SequenceBatch, max_tokens: int, *, pad_id: int = 0, seq_multiple: int = 1
) -> list[MicroBatch]:
    """Validate ``batch``, split it by the token budget and pad each micro-batch."""
    batch.validate()
    return [
        make_microbatch(batch, g, pad_id=pad_id, seq_multiple=seq_multiple)
        for g in split_by_token_budget(batch, max_tokens)
    ]


def pad_rows(mb: MicroBatch, rows: int, seq_len: int, *, pad_id: int = 0) -> MicroBatch:
    """``mb`` padded to exactly [rows, seq_len] (and at least one response column per row).

    Added rows are empty sequences: no tokens, no response (``mask`` False, zero fields), and not
    in ``indices``, so they yield no results and add nothing to a loss.
    """
    b, s = mb.input_ids.shape
    t = mb.mask.shape[1]
    if b > rows or s > seq_len:
        raise ValueError(f"micro-batch [{b}, {s}] does not fit the fixed shape [{rows}, {seq_len}]")

    def grow(x: torch.Tensor, cols: int | None = None, value=0) -> torch.Tensor:
        shape = (rows,) + ((cols,) if cols is not None else tuple(x.shape[1:]))
        out = torch.full(shape, value, dtype=x.dtype, device=x.device)
        if cols is None:
            out[: x.shape[0]] = x
        else:
            out[: x.shape[0], : x.shape[1]] = x
        return out

    return MicroBatch(
        indices=list(mb.indices),
        input_ids=grow(mb.input_ids, seq_len, pad_id),
        position_ids=torch.arange(seq_len, dtype=torch.long).unsqueeze(0).expand(rows, seq_len).contiguous(),
        resp_index=grow(mb.resp_index, t),
        targets=grow(mb.targets, t),
        mask=grow(mb.mask, t),
        token_fields={k: grow(v, t) for k, v in mb.token_fields.items()},
        seq_fields={k: grow(v) for k, v in mb.seq_fields.items()},
        prompt_lens=grow(mb.prompt_lens),
        response_lens=grow(mb.response_lens),
        filler=mb.filler,
        routing=None if mb.routing is None else _grow_routing(mb.routing, rows, seq_len),
    )


def _grow_routing(routing: torch.Tensor, rows: int, seq_len: int) -> torch.Tensor:
    out = torch.full((rows, seq_len) + tuple(routing.shape[2:]), -1, dtype=routing.dtype, device=routing.device)
    out[: routing.shape[0], : routing.shape[1]] = routing
    return out


def fixed_shape_microbatches(
    batch: SequenceBatch, max_tokens: int, num_multiple: int, *, pad_id: int = 0, seq_multiple: int = 1
) -> list[MicroBatch]:
    """Micro-batches of one shape [b, S] for a schedule that needs it, ``num_multiple`` dividing their number.

    S is the longest sequence (rounded up to ``seq_multiple``), b = max(1, max_tokens // S) sequences (at most
    all of them)
    (longest first), the last one padded with empty rows; fillers (:func:`filler_microbatch`) make the
    count a multiple of ``num_multiple``.  megatron's interleaved (virtual pipeline) schedule needs both:
    a multiple of the pipeline size, and (at PP = 2, where a rank's previous and next stage coincide) fixed
    activation shapes, because its shape exchange for variable lengths waits on messages its peer only sends
    in a later call.  The price is padding every sequence to the longest.
    """
    batch.validate()
    lengths = [int(x) for x in batch.seq_lens()]
    s = pad_to_multiple(max(max(lengths), 1), seq_multiple)
    b = max(1, min(len(lengths), max_tokens // s))
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    mbs = [make_microbatch(batch, order[i:i + b], pad_id=pad_id, seq_multiple=seq_multiple)
           for i in range(0, len(order), b)]
    mbs += [filler_microbatch(s, pad_id=pad_id) for _ in range(-len(mbs) % num_multiple)]
    t = max(mb.mask.shape[1] for mb in mbs)
    out = []
    for mb in mbs:
        if mb.mask.shape[1] < t:  # a common response width too (the loss sees [b, T] blocks)
            mb = pad_response_width(mb, t)
        out.append(pad_rows(mb, b, s, pad_id=pad_id))
    return out


def pad_response_width(mb: MicroBatch, t: int) -> MicroBatch:
    """``mb`` with its [b, T] response tensors zero-padded to ``t`` columns (padding: masked out, index 0);
    every other field, packed layout included, as it is."""
    def widen(x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros((x.shape[0], t), dtype=x.dtype, device=x.device)
        out[:, : x.shape[1]] = x
        return out

    return replace(mb, indices=list(mb.indices), resp_index=widen(mb.resp_index), targets=widen(mb.targets),
                   mask=widen(mb.mask), token_fields={k: widen(v) for k, v in mb.token_fields.items()})


def filler_microbatch(seq_len: int = 1, *, pad_id: int = 0) -> MicroBatch:
    """A one-row micro-batch of ``seq_len`` padding tokens, marked ``filler``.

    megatron's interleaved (virtual pipeline) schedule needs a multiple of the pipeline size
    micro-batches; fillers make up the difference.  They carry no response tokens and the
    policy neither computes a loss nor returns results for them.
    """
    one = SequenceBatch(input_ids=[torch.full((seq_len,), pad_id, dtype=torch.long)],
                        prompt_lens=torch.tensor([seq_len]), response_lens=torch.tensor([0]))
    mb = make_microbatch(one, [0], pad_id=pad_id)
    mb.indices = []
    mb.filler = True
    return mb


def pad_microbatch_count(mbs: list[MicroBatch], count: int, *, pad_id: int = 0, seq_multiple: int = 1,
                         fixed_shape: bool = False) -> list[MicroBatch]:
    """``mbs`` followed by filler micro-batches up to ``count`` of them.

    Ranks whose forward passes meet in a collective inside the model (megatron's all-to-all token dispatch over
    an expert-parallel group that spans data-parallel ranks) must run the same number of micro-batches, or one
    rank moves on while its peer waits.  Fillers carry no response tokens: no loss, no gradient, no results.
    With ``fixed_shape`` (the interleaved schedule) they take the shape of ``mbs``; otherwise they are one row
    of ``seq_multiple`` padding tokens.
    """
    if count < len(mbs):
        raise ValueError(f"pad_microbatch_count: count={count} is below the {len(mbs)} micro-batches given")
    if count == len(mbs):
        return mbs
    def filler() -> MicroBatch:
        if not fixed_shape:
            return filler_microbatch(pad_to_multiple(1, seq_multiple), pad_id=pad_id)
        rows, seq_len = mbs[0].input_ids.shape
        one = pad_response_width(filler_microbatch(seq_len, pad_id=pad_id), mbs[0].mask.shape[1])
        return pad_rows(one, rows, seq_len, pad_id=pad_id)

    return mbs + [filler() for _ in range(count - len(mbs))]


def unpad_response(values: torch.Tensor, mb: MicroBatch) -> list[torch.Tensor]:
    """Split a [b, T] response-token tensor of ``mb`` into per-sequence 1-D tensors."""
    return [values[row, : int(mb.response_lens[row])] for row in range(len(mb.indices))]
