"""What a weight update writes into: an engine's tensors, in place, and the layout that says what each holds.

An engine that offers one (:meth:`~mcpo_megatron.rollout.engines.interface.RolloutEngine.weight_target`) is filled
by the compiled plan (``rollout/weights/plan.py``); one that does not takes the Hugging Face stream
(``rollout/weights/resharder.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from mcpo_megatron.rollout.weights.layouts import EngineLayout


@dataclass
class WeightTarget:
    """An engine's weights as a compiled reshard plan writes them, in place: what each tensor holds (``layout``,
    :class:`~mcpo_megatron.rollout.weights.layouts.EngineLayout`) and the live tensors by destination key. ``begin``
    runs before the first write and ``finish`` after the last (vLLM's CPU build re-packs its matrices there)."""

    layout: EngineLayout
    tensors: dict[str, torch.Tensor]
    begin: Callable[[], None] | None = None
    finish: Callable[[], None] | None = None
