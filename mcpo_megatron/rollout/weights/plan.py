"""The reshard plan: where every byte of an engine's weights comes from, compiled once per layout (pure).

A weight update copies the trainer's Megatron shards into the rollout engines' tensors. The plan says, for each
engine destination tensor, which trainer rank holds each part of it, at which offsets and strides of which
Megatron parameter, and at which offsets and strides of the destination it lands. Both sides of the copy are
**strided views** (:class:`View`: a key, a shape, strides and an offset into a contiguous tensor), so a
destination is written in place, straight from the source parameter when both are on one rank, and through one
packed buffer per round and peer otherwise. Nothing in between holds a whole Hugging Face tensor.

The plan is built in Hugging Face coordinates, which both sides speak: the destinations are an engine layout's
:class:`~mcpo_megatron.rollout.weights.layouts.Fill` rows (``rollout/weights/layouts.py``); the **sources**
(:func:`~mcpo_megatron.models.shard_views.megatron_sources`) are found thus: a rectangle of an HF tensor is cut where
the Megatron layout cuts it (TP shards of rows or columns, per query group for the fused q/k/v, gate and up
halves, pipeline stages, expert-parallel ranks) and each part is a view of one Megatron parameter shard. Which
rank of those holding it sends it is :func:`choose_source`: the destination rank itself when it holds it
(colocated, then nothing moves), else the holder in the same data-parallel replica (the same node, as ranks are
laid out); an engine rank of its own draws its layers from the trainer's replicas in turn.

Pieces between two ranks move in **rounds** (:func:`assign_rounds`): each round is one ``all_to_all`` over the
transfer group in which every pair of ranks exchanges at most ``bucket_bytes / fanout`` bytes (``fanout``: the
most peers any rank sends to or receives from), so a rank's send and receive buffers stay within one bucket, and
every rank makes the same number of collective calls. Pieces larger than a pair's share are cut along their
outer dimension. Runs of pieces that differ only by a constant offset step (the fused q/k/v's groups, an expert
layout's rows) are merged into one view with one more dimension (:func:`merge_runs`), so a layer's q, k and v each
take one copy, not one per group.

Everything here is pure: the same inputs give the same plan on every rank, which is what lets a sender and its
receiver agree on the offsets of every piece without exchanging them. :class:`RankPlan` is one rank's part.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, Sequence

from mcpo_megatron.models import weights
from mcpo_megatron.models.shard_views import Owner, Rect, View, megatron_sources
from mcpo_megatron.rollout.weights.layouts import (DTYPE_BYTES, EngineLayout, Fill, TrainerLayout, TrainerRank,
                                                   engine_fills)

ALIGN = 64   # byte alignment of every piece in a packed buffer (any dtype's view of it is aligned)


class Piece(NamedTuple):
    """``dst`` on ``dst_rank`` gets ``src`` of ``src_rank`` (same shape), in the destination's ``dtype``."""

    src_rank: int
    dst_rank: int
    src: View
    dst: View
    dtype: str

    @property
    def nbytes(self) -> int:
        return self.src.numel * DTYPE_BYTES[self.dtype]


# --------------------------------------------------------------------------------------------------- sources
class SourceIndex:
    """HF tensor name -> (rule, position in the rule, owning stage) for the whole model, at the trainer's layout."""

    def __init__(self, trainer: TrainerLayout):
        self.trainer = trainer
        shape = trainer.shape
        self.rules: dict[str, tuple[weights.ParamRule, int, int]] = {}
        last = trainer.pp - 1
        for rule in weights.param_rules(shape, te=trainer.te):
            if rule.layer is not None:
                stage = trainer.layer_stage[rule.layer]
            else:
                stage = 0 if rule.mcore.startswith("embedding.") else last
            for i, name in enumerate(rule.hf):
                self.rules[name] = (rule, i, stage)
        self._shard_shapes: dict[tuple, tuple[int, ...]] = {}

    def __call__(self, hf: str, rect: Rect) -> list[tuple[Owner, View, Rect]]:
        """:func:`megatron_sources` of ``rect`` of HF tensor ``hf``."""
        if hf not in self.rules:
            raise KeyError(f"the engine expects HF tensor {hf!r}, which the Megatron model does not have")
        rule, i, stage = self.rules[hf]
        # The shard's shape depends on the rule's kind and tensors, not on its layer or expert: compute it once.
        what = (rule.kind, rule.expert is None, tuple(".".join(n.rsplit(".", 2)[-2:]) for n in rule.hf))
        if what not in self._shard_shapes:
            self._shard_shapes[what] = weights.megatron_shard_shape(self.trainer.shape, rule)
        return megatron_sources(self.trainer.shape, rule, i, stage, rect, self._shard_shapes[what])


def choose_source(trainer: TrainerLayout, owner: Owner, dst_rank: int, prefer: TrainerRank, spread: int = 0) -> int:
    """The trainer rank that sends a view held by ``owner`` to ``dst_rank``: the destination itself when it holds it,
    else the holder nearest to ``prefer`` (the destination's coordinates, or for an engine rank of its own the
    replica and tensor rank it draws from): same data and context replica (expert data replica for experts), then
    same tensor rank, then the lowest rank. An engine rank of its own (``prefer.rank`` < 0) draws layer ``spread``
    from the replica ``spread`` places further, so the trainer's data-parallel replicas share its layers."""
    dp_target, edp_target = prefer.dp, prefer.edp
    if prefer.rank < 0:
        dps = max(r.dp for r in trainer.ranks) + 1
        edps = max(r.edp for r in trainer.ranks) + 1
        dp_target, edp_target = (prefer.dp + spread) % dps, (prefer.edp + spread) % edps
    best, best_key = None, None
    for c in trainer.ranks:
        if c.pp != owner.stage or (owner.tp is not None and c.tp != owner.tp) or (
                owner.ep is not None and c.ep != owner.ep):
            continue
        if c.rank == dst_rank:
            return c.rank
        far = (c.edp != edp_target) if owner.ep is not None else (c.dp != dp_target or c.cp != prefer.cp)
        k = (far, c.tp != prefer.tp, c.rank)
        if best_key is None or k < best_key:
            best, best_key = c.rank, k
    if best is None:
        raise ValueError(f"no trainer rank holds {owner}: the trainer layout lists {len(trainer.ranks)} ranks")
    return best


# --------------------------------------------------------------------------------------------------- pieces
def merge_runs(pieces: Sequence[Piece]) -> list[Piece]:
    """Merge each run of consecutive pieces that differ only by constant source and destination offset steps into
    one piece with an outer dimension, then fuse dimensions that are contiguous on both sides."""
    out: list[Piece] = []
    i = 0
    while i < len(pieces):
        p = pieces[i]
        j = i + 1
        if j < len(pieces):
            q = pieces[j]
            ds, dd = q.src.offset - p.src.offset, q.dst.offset - p.dst.offset
            while j < len(pieces) and _same_frame(pieces[j - 1], pieces[j]) and \
                    pieces[j].src.offset - pieces[j - 1].src.offset == ds and \
                    pieces[j].dst.offset - pieces[j - 1].dst.offset == dd and ds > 0 and dd > 0:
                j += 1
        n = j - i
        if n > 1:
            src = View(p.src.key, (n,) + p.src.shape, (ds,) + p.src.stride, p.src.offset)
            dst = View(p.dst.key, (n,) + p.dst.shape, (dd,) + p.dst.stride, p.dst.offset)
            p = p._replace(src=src, dst=dst)
        out.append(_fuse_dims(p))
        i = j
    return out


def _same_frame(a: Piece, b: Piece) -> bool:
    return (a.src_rank, a.dst_rank, a.src.key, a.dst.key, a.src.shape, a.src.stride, a.dst.shape, a.dst.stride,
            a.dtype) == (b.src_rank, b.dst_rank, b.src.key, b.dst.key, b.src.shape, b.src.stride, b.dst.shape,
                         b.dst.stride, b.dtype)


def _fuse_dims(p: Piece) -> Piece:
    """Drop unit dimensions and join dimension k with k+1 where both views step contiguously over them."""
    shape = list(p.src.shape)
    ss, ds = list(p.src.stride), list(p.dst.stride)
    keep = [k for k in range(len(shape)) if shape[k] != 1] or [len(shape) - 1]
    shape, ss, ds = [shape[k] for k in keep], [ss[k] for k in keep], [ds[k] for k in keep]
    k = 0
    while k + 1 < len(shape):
        if ss[k] == shape[k + 1] * ss[k + 1] and ds[k] == shape[k + 1] * ds[k + 1]:
            shape[k:k + 2] = [shape[k] * shape[k + 1]]
            ss[k:k + 2] = [ss[k + 1]]
            ds[k:k + 2] = [ds[k + 1]]
        else:
            k += 1
    return p._replace(src=View(p.src.key, tuple(shape), tuple(ss), p.src.offset),
                      dst=View(p.dst.key, tuple(shape), tuple(ds), p.dst.offset))


def split_piece(p: Piece, max_numel: int) -> list[Piece]:
    """``p`` cut along its outer dimensions into pieces of at most ``max_numel`` elements (one innermost row may
    exceed it)."""
    if p.src.numel <= max_numel or len(p.src.shape) == 0:
        return [p]
    inner = p.src.numel // p.src.shape[0]
    if inner > max_numel and len(p.src.shape) > 1:
        out = []
        for r in range(p.src.shape[0]):
            out += split_piece(_slice0(p, r, r + 1, squeeze=True), max_numel)
        return out
    step = max(1, max_numel // max(inner, 1))
    return [_slice0(p, a, min(a + step, p.src.shape[0])) for a in range(0, p.src.shape[0], step)]


def _slice0(p: Piece, a: int, b: int, squeeze: bool = False) -> Piece:
    src, dst = p.src.index(0, a, b), p.dst.index(0, a, b)
    if squeeze:
        src = View(src.key, src.shape[1:], src.stride[1:], src.offset)
        dst = View(dst.key, dst.shape[1:], dst.stride[1:], dst.offset)
    return p._replace(src=src, dst=dst)


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


# --------------------------------------------------------------------------------------------------- the plan
@dataclass
class Round:
    """One ``all_to_all`` of a rank: per peer (transfer-group rank), the pieces it sends / receives, in order,
    each at the byte offset of the peer's slot in the packed buffer; and the slots' sizes."""

    sends: dict[int, list[tuple[int, Piece]]] = field(default_factory=dict)
    recvs: dict[int, list[tuple[int, Piece]]] = field(default_factory=dict)
    send_sizes: dict[int, int] = field(default_factory=dict)
    recv_sizes: dict[int, int] = field(default_factory=dict)

    @property
    def send_bytes(self) -> int:
        return sum(self.send_sizes.values())

    @property
    def recv_bytes(self) -> int:
        return sum(self.recv_sizes.values())


@dataclass
class RankPlan:
    """One rank's part of a plan: the pieces it copies itself, and its rounds (all ranks have ``num_rounds``)."""

    rank: int
    world: int
    local: list[Piece]
    rounds: list[Round]
    sources: set                     # source keys this rank reads
    destinations: set                # destination keys this rank writes
    fanout: int = 1

    @property
    def num_rounds(self) -> int:
        return len(self.rounds)

    @property
    def max_send_bytes(self) -> int:
        return max((r.send_bytes for r in self.rounds), default=0)

    @property
    def max_recv_bytes(self) -> int:
        return max((r.recv_bytes for r in self.rounds), default=0)

    def byte_counts(self) -> dict[str, int]:
        """Bytes copied locally, sent and received by this rank in one update."""
        return {"local": sum(p.nbytes for p in self.local),
                "sent": sum(r.send_bytes for r in self.rounds),
                "received": sum(r.recv_bytes for r in self.rounds)}


def rank_pieces(trainer: TrainerLayout, engines: Sequence[EngineLayout | None], me: int,
                prefer: Sequence[TrainerRank | None]) -> dict[tuple[int, int], list[Piece]]:
    """Every piece that ``me`` sends or receives (or copies itself), grouped by (source rank, destination rank), in
    the destination's order, merged (:func:`merge_runs`). ``engines[d]`` is destination rank ``d``'s layout (None:
    no engine), ``prefer[d]`` the coordinates its sources are chosen near (:func:`choose_source`).

    The parts of an engine layout are grouped by owner once; a destination rank's owners are resolved to source
    ranks, and only the owners whose source is ``me`` are expanded (unless ``me`` is the destination), so a rank
    visits the other ranks' destinations at the cost of a few owners each."""
    index = SourceIndex(trainer)
    cache: dict[EngineLayout, dict[tuple[Owner, int], list[tuple[int, Fill, View, Rect]]]] = {}
    me_is_trainer = any(r.rank == me for r in trainer.ranks)
    pairs: dict[tuple[int, int], list[tuple[int, Piece]]] = defaultdict(list)
    for d, layout in enumerate(engines):
        if layout is None or (d != me and not me_is_trainer):
            continue
        what = replace(layout, replica=0)  # the replica only steers the choice of sources
        if what not in cache:
            by_owner: dict[tuple[Owner, int], list[tuple[int, Fill, View, Rect]]] = defaultdict(list)
            order = 0
            for fill in engine_fills(trainer.shape, what):
                for owner, src, sub in index(fill.hf, fill.rect):
                    layer = src.key[1] if src.key[1] is not None else -1
                    by_owner[(owner, layer)].append((order, fill, src, sub))
                    order += 1
            cache[what] = dict(by_owner)
        for (owner, layer), parts in cache[what].items():
            s = choose_source(trainer, owner, d, prefer[d], spread=layer + 1)
            if s != me and d != me:
                continue
            out = pairs[(s, d)]
            for order, fill, src, sub in parts:
                out.append((order, Piece(s, d, src, fill.dst.sub(fill.rect, sub), layout.dtype)))
    merged = {}
    for pair, items in pairs.items():
        items.sort(key=lambda item: item[0])  # the destination's order, the same on both ends
        merged[pair] = merge_runs([p for _, p in items])
    return merged


def peer_count(pairs: dict[tuple[int, int], list[Piece]], me: int) -> int:
    """The most peers ``me`` sends to or receives from (at least 1)."""
    sends = {d for s, d in pairs if s == me and d != me}
    recvs = {s for s, d in pairs if d == me and s != me}
    return max(1, len(sends), len(recvs))


def assign_rounds(pairs: dict[tuple[int, int], list[Piece]], me: int, world: int, bucket_bytes: int,
                  fanout: int) -> RankPlan:
    """This rank's :class:`RankPlan`: local pieces, and each pair's pieces cut into rounds of at most
    ``bucket_bytes // fanout`` bytes (``fanout``: the largest :func:`peer_count` over the group, so that no rank's
    round exceeds one bucket). Both ends of a pair compute the same rounds from the same pieces."""
    share = max(ALIGN, bucket_bytes // max(1, fanout))
    local: list[Piece] = []
    rounds: list[Round] = []
    sources, destinations = set(), set()

    def round_at(k: int) -> Round:
        while len(rounds) <= k:
            rounds.append(Round())
        return rounds[k]

    for (s, d), pieces in sorted(pairs.items()):
        if s == me:
            sources.update(p.src.key for p in pieces)
        if d == me:
            destinations.update(p.dst.key for p in pieces)
        if s == d:
            local.extend(pieces)
            continue
        k, used = 0, 0
        for whole in pieces:
            per_elem = DTYPE_BYTES[whole.dtype]
            for p in split_piece(whole, max(1, share // per_elem)):
                size = aligned(p.nbytes)
                if used and used + size > share:
                    k, used = k + 1, 0
                rd = round_at(k)
                if s == me:
                    rd.sends.setdefault(d, []).append((used, p))
                    rd.send_sizes[d] = used + size
                else:
                    rd.recvs.setdefault(s, []).append((used, p))
                    rd.recv_sizes[s] = used + size
                used += size
    return RankPlan(me, world, local, rounds, sources, destinations, fanout)


def pad_rounds(plan: RankPlan, num_rounds: int) -> RankPlan:
    """``plan`` with empty rounds appended up to ``num_rounds`` (every rank calls the same number of collectives)."""
    while len(plan.rounds) < num_rounds:
        plan.rounds.append(Round())
    return plan


def compile_rank_plan(trainer: TrainerLayout, engines: Sequence[EngineLayout | None], me: int,
                      prefer: Sequence[TrainerRank | None], bucket_bytes: int, *, max_over_ranks=None) -> RankPlan:
    """This rank's plan. ``max_over_ranks(int) -> int`` agrees on the fanout and the number of rounds over the
    transfer group (a MAX all-reduce; identity for one process or a pure computation)."""
    agree = max_over_ranks or (lambda x: x)
    pairs = rank_pieces(trainer, engines, me, prefer)
    fanout = agree(peer_count(pairs, me))
    plan = assign_rounds(pairs, me, len(engines), bucket_bytes, fanout)
    return pad_rounds(plan, agree(plan.num_rounds))


def trainer_rank_of(trainer: TrainerLayout, rank: int) -> TrainerRank | None:
    for r in trainer.ranks:
        if r.rank == rank:
            return r
    return None


def engine_preference(trainer: TrainerLayout, layout: EngineLayout) -> TrainerRank:
    """Coordinates an engine rank of its own draws from (rank -1: not a trainer rank): trainer replicas in turn by
    engine replica, tensor ranks in turn by its tensor rank (so engine replicas spread over the trainer's
    data-parallel replicas; :func:`choose_source` spreads each replica's layers over them too)."""
    dp = max(r.dp for r in trainer.ranks) + 1
    edp = max(r.edp for r in trainer.ranks) + 1
    tp = trainer.shape.tp
    return TrainerRank(-1, 0, layout.tp_rank % tp, dp=layout.replica % dp, cp=0, ep=0, edp=layout.replica % edp)


def preferences(trainer: TrainerLayout, engines: Sequence[EngineLayout | None]) -> list[TrainerRank | None]:
    """Per destination rank: its own coordinates when it is a trainer rank (colocated), else
    :func:`engine_preference`."""
    out: list[TrainerRank | None] = []
    for d, layout in enumerate(engines):
        if layout is None:
            out.append(None)
        else:
            out.append(trainer_rank_of(trainer, d) or engine_preference(trainer, layout))
    return out


def describe(plan: RankPlan) -> dict[str, Any]:
    """Counts for logs and benchmarks."""
    counts = plan.byte_counts()
    return dict(rounds=plan.num_rounds, fanout=plan.fanout, local_pieces=len(plan.local),
                sent_pieces=sum(len(v) for r in plan.rounds for v in r.sends.values()),
                received_pieces=sum(len(v) for r in plan.rounds for v in r.recvs.values()),
                max_send_bytes=plan.max_send_bytes, max_recv_bytes=plan.max_recv_bytes, **counts)
