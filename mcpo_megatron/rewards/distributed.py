"""Scoring split over the ranks of a job: each rank verifies a contiguous slice, the results are gathered."""

from __future__ import annotations

from mcpo_megatron.parallel.distributed import all_gather_objects


class DistributedScorer:
    """A reward scorer whose ``score`` splits the items over the ranks and gathers the results."""

    def __init__(self, scorer, rank: int, world_size: int):
        self.scorer, self.rank, self.world_size = scorer, rank, world_size

    def score(self, responses: list[str], golds: list[str], truncated: list[bool] | None = None):
        n = len(responses)
        lo, hi = n * self.rank // self.world_size, n * (self.rank + 1) // self.world_size
        part_truncated = truncated[lo:hi] if truncated is not None else None
        mine = self.scorer.score(responses[lo:hi], golds[lo:hi], part_truncated) if hi > lo else []
        if self.world_size == 1:
            return mine
        return [r for part in all_gather_objects(mine) for r in part]
