"""Deterministic prompt sampler: seeded shuffle per epoch, identical global batches on every rank."""

from __future__ import annotations

import numpy as np


class PromptSampler:
    """Draws global batches of prompt indices, one per training step.

    Epoch ``e`` visits the prompts in the order ``permutation(seed, e)`` (a NumPy generator seeded
    with ``[seed, e]``, so every rank computes the same order without communication, and
    resuming needs only ``(epoch, position)``). With ``drop_last`` a tail shorter than a batch is
    skipped; otherwise it forms a smaller last batch of the epoch.
    """

    def __init__(self, num_prompts: int, batch_size: int, *, seed: int, shuffle: bool = True, drop_last: bool = True):
        if num_prompts < 1:
            raise ValueError(f"PromptSampler: num_prompts={num_prompts} must be >= 1; the prompt set is empty")
        if batch_size < 1:
            raise ValueError(f"PromptSampler: batch_size={batch_size} must be >= 1")
        if drop_last and batch_size > num_prompts:
            raise ValueError(
                f"PromptSampler: batch_size={batch_size} > num_prompts={num_prompts} with drop_last=True would never "
                "yield a batch; lower the batch size, load more prompts or set drop_last=False"
            )
        self.num_prompts = int(num_prompts)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.position = 0
        self.batches_drawn = 0
        self._order_epoch = -1
        self._order: np.ndarray | None = None

    def order(self, epoch: int) -> np.ndarray:
        """Prompt order of ``epoch``."""
        if not self.shuffle:
            return np.arange(self.num_prompts)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts)

    def _current_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            self._order = self.order(self.epoch)
            self._order_epoch = self.epoch
        return self._order

    def next_batch(self) -> list[int]:
        """The next GLOBAL batch of prompt indices (the same list on every rank)."""
        left = self.num_prompts - self.position
        if left == 0 or (self.drop_last and left < self.batch_size):
            self.epoch += 1
            self.position = 0
        order = self._current_order()
        batch = order[self.position: self.position + self.batch_size]
        self.position += len(batch)
        self.batches_drawn += 1
        return [int(i) for i in batch]

    @property
    def batches_per_epoch(self) -> int:
        full, rest = divmod(self.num_prompts, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    @staticmethod
    def shard(indices: list[int], rank: int, world: int) -> list[int]:
        """This rank's contiguous share of ``indices`` (the first ``len % world`` ranks get one more)."""
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"shard: need 0 <= rank < world, got rank={rank}, world={world}")
        base, extra = divmod(len(indices), world)
        start = rank * base + min(rank, extra)
        return list(indices[start: start + base + (1 if rank < extra else 0)])

    def state_dict(self) -> dict:
        return {
            "num_prompts": self.num_prompts, "batch_size": self.batch_size, "seed": self.seed,
            "shuffle": self.shuffle, "drop_last": self.drop_last,
            "epoch": self.epoch, "position": self.position, "batches_drawn": self.batches_drawn,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume: the next batches equal those the uninterrupted sampler would have drawn."""
        for key in ("num_prompts", "batch_size", "seed", "shuffle", "drop_last"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"PromptSampler.load_state_dict: checkpoint has {key}={state[key]!r} but this sampler has "
                    f"{key}={getattr(self, key)!r}; resume with the same data and batch settings"
                )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.batches_drawn = int(state.get("batches_drawn", 0))
        self._order_epoch = -1
