"""A context in which float64 tensors are not cast down to float32 (``Tensor.float()`` / ``Tensor.to(float32)``).

transformers' Qwen3-Next / Qwen3.5 fallbacks and megatron's Gated DeltaNet compute parts of the layer in float32
on purpose (``.float()`` before the decay, the gate and the norm).  Float64 parity tests compare the arithmetic,
not those casts: inside this context a float64 tensor stays float64, so both sides agree to float64 rounding.
Tensors of other dtypes convert as usual.
"""

import contextlib

import torch


@contextlib.contextmanager
def keep_float64():
    orig_float, orig_to = torch.Tensor.float, torch.Tensor.to

    def float_(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else orig_float(self, *args, **kwargs)

    def to(self, *args, **kwargs):
        if self.dtype == torch.float64:
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            if kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = torch.float64
        return orig_to(self, *args, **kwargs)

    torch.Tensor.float, torch.Tensor.to = float_, to
    try:
        yield
    finally:
        torch.Tensor.float, torch.Tensor.to = orig_float, orig_to
