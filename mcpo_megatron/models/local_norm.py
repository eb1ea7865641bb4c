"""RMSNorm for megatron-core's local (non-Transformer-Engine) layer spec, usable with sequence parallelism.

megatron's ``WrappedTorchNorm`` returns a plain ``torch.nn.RMSNorm`` but refuses ``sequence_parallel``: with
sequence parallelism each tensor-parallel rank normalises its own slice of the sequence, so the norm's weight
gradient is partial and must be summed over TP.  ``finalize_model_grads`` does that for every parameter whose
``sequence_parallel`` attribute is set, which is all this class adds (TE's norms set the same attribute).  The
forward is torch's RMSNorm, as with ``WrappedTorchNorm``.  Mixture-of-experts layers need it: megatron trains
MoE with TP > 1 only under sequence parallelism.

With ``config.layernorm_zero_centered_gamma`` (Qwen3.5's norms multiply by ``1 + weight``) the weight starts at
zero and the forward scales by ``1 + weight``, as Transformer Engine's norms do with ``zero_centered_gamma``
(``WrappedTorchNorm`` refuses the setting).  :class:`PlainLocalRMSNorm` ignores that setting: a Gated DeltaNet's
gated output norm, which HF keeps plain (``weight * x_hat``) while the decoder's other norms are zero-centered.
"""

from __future__ import annotations

import torch


class LocalRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm(hidden_size, eps)`` whose weight is marked ``sequence_parallel`` like megatron's own."""

    zero_centered_from_config = True

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused) -> None:
        if config.normalization != "RMSNorm":
            raise ValueError(f"LocalRMSNorm implements RMSNorm, not {config.normalization!r}")
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = bool(config.sequence_parallel)
        self.zero_centered_gamma = self.zero_centered_from_config and bool(
            getattr(config, "layernorm_zero_centered_gamma", False))
        if self.zero_centered_gamma:
            with torch.no_grad():
                self.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.zero_centered_gamma:
            return super().forward(x)
        return torch.nn.functional.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


class PlainLocalRMSNorm(LocalRMSNorm):
    """:class:`LocalRMSNorm` scaling by ``weight`` whatever ``layernorm_zero_centered_gamma`` says: a Gated
    DeltaNet's gated ``out_norm``. Each TP rank applies it to its own value heads, so its weight's gradient is
    partial over TP with or without sequence parallelism (``partial_over_tp``: the policy sums it,
    ``models/policy.sum_head_norm_grads``)."""

    zero_centered_from_config = False

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused) -> None:
        super().__init__(config, hidden_size, eps, **unused)
        self.weight.partial_over_tp = True
