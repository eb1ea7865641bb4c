"""Megatron parameter shards as strided views of Hugging Face tensors (pure): the inverse of
:func:`~mcpo_megatron.models.weights.megatron_shards_to_hf`, one rectangle at a time.

A :class:`View` is ``tensor.as_strided(shape, stride, offset)`` of a contiguous tensor. :func:`megatron_sources`
cuts a rectangle of an HF tensor where the Megatron layout cuts it (TP shards of rows or columns, the fused q/k/v
per query group, the gate and up halves) and names, for each part, the shard that holds it (:class:`Owner`: the
pipeline stage, the TP rank, the expert-parallel rank) and where in that shard it sits. The HF stream
(:mod:`~mcpo_megatron.models.hf_io`) assembles HF tensors from gathered shards with it; the reshard plan
(``rollout/weights/plan.py``) composes it with an engine's layout.
"""

from __future__ import annotations

from typing import Hashable, NamedTuple, Sequence

from mcpo_megatron.models import weights
from mcpo_megatron.models.registry import MegatronShape

Rect = tuple[tuple[int, int], ...]   # per dimension of an HF tensor: [start, stop)


class View(NamedTuple):
    """``tensor.as_strided(shape, stride, offset)`` of the contiguous tensor named ``key``."""

    key: Hashable
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def extent(self) -> int:
        """One past the largest element offset the view reaches (for bounds checks)."""
        if self.numel == 0:
            return self.offset
        return self.offset + sum((s - 1) * st for s, st in zip(self.shape, self.stride)) + 1

    def sub(self, origin: Rect, rect: Rect) -> "View":
        """The view of ``rect`` when this view holds ``origin`` (both in the same coordinates, ``rect`` inside)."""
        offset, shape = self.offset, []
        for (a, b), (o, _), st in zip(rect, origin, self.stride):
            offset += (a - o) * st
            shape.append(b - a)
        return View(self.key, tuple(shape), self.stride, offset)

    def index(self, dim: int, start: int, stop: int) -> "View":
        """Entries ``start:stop`` along ``dim``."""
        shape = list(self.shape)
        shape[dim] = stop - start
        return View(self.key, tuple(shape), self.stride, self.offset + start * self.stride[dim])


def contiguous_view(key: Hashable, shape: Sequence[int]) -> View:
    shape = tuple(int(s) for s in shape)
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return View(key, shape, tuple(reversed(stride)), 0)


def rect_of(shape: Sequence[int]) -> Rect:
    return tuple((0, int(s)) for s in shape)


class Owner(NamedTuple):
    """Which trainer ranks hold a source view: pipeline stage, tensor rank (None: every tensor rank holds the same
    values) and, for an expert's weights, its expert-parallel rank."""

    stage: int
    tp: int | None
    ep: int | None = None


def source_key(rule: weights.ParamRule) -> tuple:
    """The key of a Megatron parameter in a plan: its rule's name pattern, global layer and global expert."""
    return (rule.mcore, rule.layer, rule.expert)


def _cuts(start: int, stop: int, step: int) -> list[tuple[int, int, int]]:
    """[start, stop) cut at multiples of ``step``: (block index, start, stop) per part."""
    out, a = [], start
    while a < stop:
        b = min(stop, (a // step + 1) * step)
        out.append((a // step, a, b))
        a = b
    return out


def megatron_sources(shape: MegatronShape, rule: weights.ParamRule, i: int, stage: int, rect: Rect,
                     shard_shape: tuple[int, ...] | None = None) -> list[tuple[Owner, View, Rect]]:
    """The parts of ``rect`` of the ``i``-th HF tensor of ``rule`` as views of Megatron TP shards: (owner, view of
    the shard, the part of ``rect`` it holds). Inverts :func:`~mcpo_megatron.models.weights.megatron_shards_to_hf`
    (its docstring states the layouts). ``shard_shape``: the rule's shard shape when already known."""
    key, tp = source_key(rule), shape.tp
    ep = rule.expert // shape.num_local_experts if rule.expert is not None else None
    shard = contiguous_view(key, shard_shape or weights.megatron_shard_shape(shape, rule))
    shard_rect = rect_of(shard.shape)

    def at(rank: int | None, rows: tuple[int, int], part: Rect, cols: tuple[int, int] | None = None) -> tuple:
        """``part`` of the HF rect sits at shard rows ``rows`` (and columns ``cols``, default: as in ``part``)."""
        where = (rows,) + (() if len(part) == 1 else ((cols if cols is not None else part[1]),) + part[2:])
        return Owner(stage, rank, ep), shard.sub(shard_rect, where), part

    rows, rest = rect[0], rect[1:]
    kind = rule.kind
    if kind == "copy":
        return [(Owner(stage, None, ep), shard.sub(shard_rect, rect), rect)]
    if kind == "vocab":
        n = shape.vocab_size // tp
        return [at(t, (a - t * n, b - t * n), ((a, b),) + rest) for t, a, b in _cuts(*rows, n)]
    if kind == "row":
        n = weights.ffn_width(shape, rule) // tp
        return [at(t, rows, (rows, (a, b)), (a - t * n, b - t * n)) for t, a, b in _cuts(*rect[1], n)]
    if kind == "proj":
        n = shape.num_attention_heads // tp * shape.head_dim
        return [at(t, rows, (rows, (a, b)), (a - t * n, b - t * n)) for t, a, b in _cuts(*rect[1], n)]
    if kind == "gate_up":
        n = weights.ffn_width(shape, rule) // tp
        return [at(t, (i * n + a - t * n, i * n + b - t * n), ((a, b),) + rest) for t, a, b in _cuts(*rows, n)]
    if kind == "qkv":
        hd, hpg = shape.head_dim, shape.heads_per_group
        per_rank = shape.num_query_groups // tp
        size = hpg * hd if i == 0 else hd          # rows of one query group in this HF tensor
        base = (0, hpg * hd, (hpg + 1) * hd)[i]      # where they start in the group's fused block
        out = []
        for g, a, b in _cuts(*rows, size):
            t, local = divmod(g, per_rank)
            first = local * (hpg + 2) * hd + base + (a - g * size)
            out.append(at(t, (first, first + b - a), ((a, b),) + rest))
        return out
    if kind == "qkv_gated":
        hd, hpg = shape.head_dim, shape.heads_per_group
        per_rank, block = shape.num_query_groups // tp, (2 * hpg + 2) * hd
        out = []
        if i == 0:  # q_proj: head h's rows are [q_h; gate_h], hd each; cut at every hd
            for c, a, b in _cuts(*rows, hd):
                head, is_gate = divmod(c, 2)
                g, j = divmod(head, hpg)
                t, local = divmod(g, per_rank)
                first = local * block + is_gate * hpg * hd + j * hd + (a - c * hd)
                out.append(at(t, (first, first + b - a), ((a, b),) + rest))
            return out
        base = (2 * hpg + i - 1) * hd  # k after the group's queries and gates, then v
        for g, a, b in _cuts(*rows, hd):
            t, local = divmod(g, per_rank)
            first = local * block + base + (a - g * hd)
            out.append(at(t, (first, first + b - a), ((a, b),) + rest))
        return out
    if kind in weights.SECTION_KINDS:
        out, offset = [], 0  # offset: where the section starts in every rank's shard
        for j, start, n in weights.gdn_sections(shape, rule):
            m = n // tp
            lo, hi = max(rows[0], start), min(rows[1], start + n)
            if j == i and lo < hi:
                for t, a, b in _cuts(lo - start, hi - start, m):
                    first = offset + a - t * m
                    out.append(at(t, (first, first + b - a), ((start + a, start + b),) + rest))
            offset += m
        return out
    raise ValueError(f"unknown rule kind {kind!r}")


