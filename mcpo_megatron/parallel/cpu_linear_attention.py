"""Plain-torch references for the linear-attention kernels megatron-core's Gated DeltaNet imports (CPU only).

megatron-core's ``GatedDeltaNet`` (``megatron/core/ssm/gated_delta_net.py`` in 0.16.1, the
``megatron/core/ssm/gated_delta_net/`` package in 0.19) takes its kernels from flash-linear-attention (Triton) and,
in 0.19, its causal convolution from the same package: ``fla.modules.l2norm.l2norm``,
``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` and ``fla.modules.convolution.causal_conv1d``.  Triton does not
run on a CPU, so ``cpu_shim.apply_cpu_shim`` installs the functions below in their place on CPU-only machines.  They
are CPU references: on GPUs the real packages are required and these are never used.

0.16.1 imports ``causal_conv1d.causal_conv1d_fn`` (the causal-conv1d package) too, but falls back to its own
``nn.Conv1d`` when the import fails; that fallback runs on the CPU as it is, so no stand-in is needed for it.

The gated delta rule (Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule", 2024),
per head, with a state ``S`` of shape ``[V, K]``::

    S_t = S_{t-1} * exp(g_t) * (I - beta_t k_t k_t^T) + beta_t v_t k_t^T
    o_t = S_t q_t * scale

flash-linear-attention stores the transpose (``h = S^T`` of shape ``[K, V]``, ``o_t = q_t^T h_t``); the initial and
final states here use that ``[N, H, K, V]`` layout.  The chunked form (the WY / UT transform of DeltaNet) computes
the same values in chunks of 64 steps: within a chunk ``T = (I + strict_lower(beta_i k_i.k_j exp(G_i - G_j)))^-1``
(``G`` the cumulative log decay), ``U = T (beta v)``, ``W = T (beta k exp(G))``, then per chunk
``v_new = U - W h``, ``o = (q exp(G)) h + causal(q k^T exp(G_i - G_j)) v_new`` and
``h <- h exp(G_last) + (k exp(G_last - G))^T v_new``.

Everything is written with differentiable torch ops (autograd gives the backward), on the inputs' device, in the
inputs' dtype promoted to at least float32 (as the Triton kernels accumulate in float32; float64 stays float64).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64  # flash-linear-attention's chunk length for the gated delta rule


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def l2norm(x: torch.Tensor, eps: float = 1e-6, output_dtype: torch.dtype | None = None, dim: int = -1) -> torch.Tensor:
    """``fla.modules.l2norm.l2norm``: ``x / sqrt(sum(x^2) + eps)`` over the last dimension.

    ``dim`` is accepted because megatron's own ``torch_chunk_gated_delta_rule`` passes ``dim=-1``; only the last
    dimension is supported, as in flash-linear-attention.
    """
    if dim not in (-1, x.dim() - 1):
        raise ValueError(f"l2norm normalises the last dimension only (got dim={dim} for a {x.dim()}-d tensor)")
    y = x.to(_compute_dtype(x.dtype))
    y = y * torch.rsqrt((y * y).sum(dim=-1, keepdim=True) + eps)
    return y.to(output_dtype if output_dtype is not None else x.dtype)


def _gated_delta_rule_one(q, k, v, g, beta, scale, state, chunk_size):
    """One sequence: q, k [T, H, K], v [T, H, V], g, beta [T, H], state [H, K, V]; returns o [T, H, V], state."""
    seq_len = q.shape[0]
    pad = (chunk_size - seq_len % chunk_size) % chunk_size
    # [H, T, ...] and pad the sequence to whole chunks: padded steps have k = v = beta = g = 0 (no update, no decay).
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x.transpose(0, 1), (0, pad)) for x in (g, beta))
    heads, padded_len, dk = k.shape
    n = padded_len // chunk_size
    q = q * scale
    q, k, v = (x.reshape(heads, n, chunk_size, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(heads, n, chunk_size), beta.reshape(heads, n, chunk_size)

    G = g.cumsum(-1)  # cumulative log decay inside each chunk
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    strict = causal.tril(-1)
    # exp(G_i - G_j) for j <= i; the rest is masked before exp (it could overflow) and contributes 0.
    decay = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    eye = torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    system = eye + ((k_beta @ k.transpose(-1, -2)) * decay).masked_fill(~strict, 0.0)
    u = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * G.exp().unsqueeze(-1), upper=False, unitriangular=True)
    intra = ((q @ k.transpose(-1, -2)) * decay).masked_fill(~causal, 0.0)
    q_decayed = q * G.exp().unsqueeze(-1)
    k_to_end = k * (G[..., -1:] - G).exp().unsqueeze(-1)
    chunk_decay = G[..., -1].exp()

    outputs = []
    for c in range(n):
        v_new = u[:, c] - w[:, c] @ state
        outputs.append(q_decayed[:, c] @ state + intra[:, c] @ v_new)
        state = state * chunk_decay[:, c, None, None] + k_to_end[:, c].transpose(-1, -2) @ v_new
    out = torch.cat(outputs, dim=1)[:, :seq_len]  # [H, T, V]
    return out.transpose(0, 1), state


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (flash-linear-attention 0.4 signature), CPU reference.

    q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g (log decay, <= 0) and beta: ``[B, T, H]``.  ``scale`` defaults to
    ``K ** -0.5``.  ``initial_state`` / the returned final state: ``[N, H, K, V]`` with ``N`` the number of sequences
    (``B``, or ``len(cu_seqlens) - 1`` for variable-length input, which needs ``B == 1``: each sequence then runs
    separately from its own initial state).  Returns the output in q's dtype and the final state (in the compute
    dtype) or None.
    """
    if kwargs.pop("head_first", False):
        raise ValueError("chunk_gated_delta_rule: head_first=True is not supported (flash-linear-attention 0.4 "
                         "takes [B, T, H, ...])")
    kwargs.pop("cu_seqlens_cpu", None)  # a host copy of cu_seqlens some callers pass; the reference reads cu_seqlens
    if kwargs:
        raise TypeError(f"chunk_gated_delta_rule: unsupported arguments {sorted(kwargs)}")
    if not (q.shape == k.shape and q.shape[:3] == v.shape[:3] and g.shape == beta.shape == q.shape[:3]):
        raise ValueError(f"chunk_gated_delta_rule: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"g {tuple(g.shape)}, beta {tuple(beta.shape)} do not share [B, T, H] (q/k heads must "
                         "equal v heads: repeat them first)")
    batch, total, heads, dk = q.shape
    out_dtype = q.dtype
    dtype = _compute_dtype(q.dtype)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    scale = dk ** -0.5 if scale is None else scale

    if cu_seqlens is None:
        spans = [(b, 0, total) for b in range(batch)]
    else:
        if batch != 1:
            raise ValueError(f"chunk_gated_delta_rule: cu_seqlens needs batch size 1, got {batch}")
        bounds = [int(x) for x in cu_seqlens.tolist()]
        if bounds[0] != 0 or bounds[-1] != total or any(b > a for a, b in zip(bounds[1:], bounds)):
            raise ValueError(f"chunk_gated_delta_rule: cu_seqlens {bounds} do not cover the {total} tokens in order")
        spans = [(0, a, b) for a, b in zip(bounds, bounds[1:])]
    if initial_state is not None and initial_state.shape != (len(spans), heads, dk, v.shape[-1]):
        raise ValueError(f"chunk_gated_delta_rule: initial_state {tuple(initial_state.shape)} is not "
                         f"[{len(spans)}, {heads}, {dk}, {v.shape[-1]}]")

    outputs, states = [], []
    for i, (b, start, end) in enumerate(spans):
        state = (initial_state[i].to(dtype) if initial_state is not None
                 else q.new_zeros(heads, dk, v.shape[-1]))
        out, state = _gated_delta_rule_one(q[b, start:end], k[b, start:end], v[b, start:end], g[b, start:end],
                                           beta[b, start:end], scale, state, chunk_size)
        outputs.append(out)
        states.append(state)
    if cu_seqlens is None:
        o = torch.stack(outputs)
    else:
        o = torch.cat(outputs).unsqueeze(0)
    return o.to(out_dtype), (torch.stack(states) if output_final_state else None)


_ACTIVATIONS = {None: None, "silu": F.silu, "swish": F.silu}


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    activation: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``fla.modules.convolution.causal_conv1d``: depthwise causal convolution, CPU reference.

    x: ``[B, T, D]``; weight: ``[D, W]``; ``y_t = act(bias + sum_i weight[:, i] * x_{t - W + 1 + i})`` with zeros
    before each sequence's start (each span of ``cu_seqlens`` starts afresh, B == 1).  Returns ``(y, None)``.
    The convolution caches (``initial_state`` / ``output_final_state``) serve inference, which megatron's GDN
    refuses; they and ``residual`` are refused here rather than guessed.
    """
    kwargs.pop("backend", None)  # the kernel choice (triton / cuda) of the real function
    if kwargs:
        raise TypeError(f"causal_conv1d: unsupported arguments {sorted(kwargs)}")
    if initial_state is not None or output_final_state or residual is not None:
        raise NotImplementedError("causal_conv1d (CPU reference): initial_state, output_final_state and residual "
                                  "are not supported")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"causal_conv1d: activation {activation!r} is not one of {sorted(map(str, _ACTIVATIONS))}")
    width = weight.shape[-1]
    if cu_seqlens is None:
        pieces = [x]
    else:
        if x.shape[0] != 1:
            raise ValueError(f"causal_conv1d: cu_seqlens needs batch size 1, got {x.shape[0]}")
        bounds = [int(b) for b in cu_seqlens.tolist()]
        pieces = [x[:, a:b] for a, b in zip(bounds, bounds[1:])]
    outs = []
    for piece in pieces:
        seq_len = piece.shape[1]
        y = F.conv1d(piece.transpose(1, 2), weight.unsqueeze(1), bias, padding=width - 1,
                     groups=weight.shape[0])[..., :seq_len]
        outs.append(y.transpose(1, 2))
    y = torch.cat(outs, dim=1)
    act = _ACTIVATIONS[activation]
    return (act(y) if act is not None else y), None
