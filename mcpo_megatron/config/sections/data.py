"""What is trained on and how it is scored: the ``data`` section (dataset, batch, lengths) and ``reward``
(the verifier and DAPO's overlong shaping)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from mcpo_megatron.config.checks import Checks, at_least, choice


@dataclass
class DataConfig:
    train: str = "dapo_math_17k"                  # dataset spec: "dapo_math_17k", "reasoning_gym:<task>", "jsonl:<path>"
    train_path: Optional[str] = None              # local file instead of the hub
    train_batch_size: int = at_least(128, 1)      # prompts per global step
    max_prompt_length: int = at_least(2048, 1)
    max_response_length: int = at_least(20480, 1)  # L_max of overlong shaping
    prompt_template: str = choice("dapo", "boxed", "number", "raw", "python_tool")  # data.templates.TEMPLATES
    apply_chat_template: bool = True
    shuffle: bool = True
    seed: int = 0
    num_train_samples: Optional[int] = None       # size of generated sets (reasoning_gym)

    def check(self, c: Checks) -> None:
        mini = c.cfg.algorithm.mini_batch_size
        if mini >= 1 and self.train_batch_size >= 1 and self.train_batch_size % mini:
            c.error("data.train_batch_size", self.train_batch_size,
                    f"must be divisible by algorithm.mini_batch_size={mini}",
                    "make the global batch a whole number of mini-batches")
        total = self.max_prompt_length + self.max_response_length
        shape = c.shape
        if shape is not None and shape.max_position_embeddings and total > shape.max_position_embeddings:
            c.error("data.max_prompt_length+data.max_response_length", total,
                    f"must be <= max_position_embeddings={shape.max_position_embeddings} (from {shape.source})",
                    "shorten data.max_prompt_length / data.max_response_length")


@dataclass
class OverlongBufferConfig:
    """DAPO soft overlong punishment (docs/algorithms.md §9)."""
    enable: bool = True
    len: int = 4096
    penalty_factor: float = 1.0

    def check(self, c: Checks) -> None:
        if not self.enable:
            return
        max_response = c.cfg.data.max_response_length
        if not 0 < self.len <= max_response:
            c.error("reward.overlong_buffer.len", self.len,
                    f"must satisfy 0 < len <= data.max_response_length={max_response}",
                    "use e.g. 4096, or reward.overlong_buffer.enable=false")
        if self.penalty_factor < 0:
            c.error("reward.overlong_buffer.penalty_factor", self.penalty_factor, "must be >= 0", "use 1.0")


# The smallest RLIMIT_AS a reward worker starts under (16 MiB failed to import math-verify, 64 MiB started);
# rewards/scorer.py refuses the same values.
MIN_REWARD_MEMORY_MB = 64


@dataclass
class RewardConfig:
    num_workers: int = at_least(2, 1)
    timeout_s: float = 10.0                       # wall-clock kill of one verification
    memory_mb: int = 2048                         # RLIMIT_AS of a verifier worker in MiB; 0: no cap
    correct_score: float = 1.0
    incorrect_score: float = -1.0
    answer_format: str = choice("dapo", "boxed", "last_number")  # dapo: the "Answer:" line
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)

    def check(self, c: Checks) -> None:
        if not (self.memory_mb == 0 or self.memory_mb >= MIN_REWARD_MEMORY_MB):
            c.error("reward.memory_mb", self.memory_mb,
                    f"must be 0 (no cap) or >= {MIN_REWARD_MEMORY_MB} (MiB of address space; a verifier worker "
                    "cannot import math-verify in less)", "use the default 2048")
        if not self.timeout_s > 0:
            c.error("reward.timeout_s", self.timeout_s, "must be > 0 (wall-clock kill of a verifier call)",
                    "use e.g. 10")
        if self.correct_score <= self.incorrect_score:
            c.error("reward.correct_score", self.correct_score,
                    f"must be > reward.incorrect_score={self.incorrect_score}", "use 1.0 / -1.0")
