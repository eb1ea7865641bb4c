"""RMSNorm for megatron-core's local (non-Transformer-Engine) layer spec, usable with sequence parallelism.

megatron's ``WrappedTorchNorm`` returns a plain ``torch.nn.RMSNorm`` but refuses ``sequence_parallel``: with
sequence parallelism each tensor-parallel rank normalises its own slice of the sequence, so the norm's weight
gradient is partial and must be summed over TP.  ``finalize_model_grads`` does that for every parameter whose
``sequence_parallel`` attribute is set, which is all this class adds (TE's norms set the same attribute).  The
forward is torch's RMSNorm, as with ``WrappedTorchNorm``.  Mixture-of-experts layers need it: megatron trains
MoE with TP > 1 only under sequence parallelism.
"""

from __future__ import annotations

import torch


class LocalRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm(hidden_size, eps)`` whose weight is marked ``sequence_parallel`` like megatron's own."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused) -> None:
        if config.normalization != "RMSNorm":
            raise ValueError(f"LocalRMSNorm implements RMSNorm, not {config.normalization!r}")
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = bool(config.sequence_parallel)
