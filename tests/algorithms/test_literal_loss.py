"""The fused loss training calls equals the literal definition (autograd through plain torch ops) on every term:
value, gradients of logp and entropy, and every metric sum, in float64 to rounding and in float32 to its
precision; NaN in the padding changes neither."""

from pathlib import Path

import pytest
import torch

from mcpo_megatron.algorithms.off_policy import MaskSettings, behaviour_mask
from mcpo_megatron.algorithms import (
    LOSS_AGG_MODES,
    LossInputs,
    LossSettings,
    literal_policy_loss,
    local_counts,
    policy_loss,
    token_weights,
)

F64 = torch.float64
BENCH = Path(__file__).resolve().parents[2] / "bench"

# (terms besides the PG term, settings): every setting of LossSettings is used by one of them
TERMS = {
    "pg": ((), {}),
    "pg+hinge": (("hinge",), {}),
    "all, k3": (("hinge", "kl", "tis", "entropy"), dict(kl_coef=0.1, kl_type="k3", tis_cap=2.0, entropy_coeff=0.01)),
    "clamps active, k1, no dual clip": (("hinge", "kl"), dict(kl_coef=0.2, kl_type="k1", clip_c=None, d_clamp=0.5,
                                                              log_ratio_clamp=1.0)),
    "k2, mismatch metrics only": (("kl", "tis"), dict(kl_coef=0.2, kl_type="k2", hinge_coef=0.5)),
    "tis and behaviour masks": (("hinge", "tis", "mask"), dict(tis_cap=2.0)),
}


def make_batch(dtype, pad, seed=0, B=12, T=40):
    """Drawn in float64, then cast: the float32 batch holds the same numbers, rounded."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = torch.arange(T)[None, :] < lengths[:, None]
    old = -2 * torch.rand(B, T, generator=g, dtype=F64)
    logp = old + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    logp[1, 0] = old[1, 0] + 3.0  # r = 20: dual clip, and beyond the smaller clamps
    logp[2, 1] = old[2, 1] - 25.0  # beyond log_ratio_clamp
    adv = torch.randn(B, generator=g, dtype=F64)
    adv[1], adv[3] = -1.5, 0.0
    ref = logp + 0.4 * torch.randn(B, T, generator=g, dtype=F64)
    ref[0, 0] = logp[0, 0] + 30.0  # beyond the k3 clamps
    rollout = old + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    entropy = torch.rand(B, T, generator=g, dtype=F64)
    # the token and sequence masks of rows drawn like rollout: some tokens and some whole rows masked
    settings = MaskSettings(token_band=(0.8, 1.25), sequence_band=(0.95, 1.05))
    behaviour = torch.stack([behaviour_mask(old[i], rollout[i], settings) for i in range(B)])

    def padded(x):
        return torch.where(mask, x, torch.full_like(x, pad)).to(dtype)

    return dict(mask=mask, mastered=torch.rand(B, generator=g) < 0.5, adv=adv.to(dtype), old=padded(old),
                logp=padded(logp), ref=padded(ref), rollout=padded(rollout), entropy=padded(entropy), dtype=dtype,
                behaviour=behaviour.to(dtype))


def run(loss_fn, b, mode, terms, settings):
    c = local_counts(b["mask"], b["mastered"])
    pg_w, hkl_w = token_weights(b["mask"], b["mastered"], loss_agg_mode=mode, global_counts=c,
                                max_response_length=64, dtype=b["dtype"])
    logp = b["logp"].clone().requires_grad_(True)
    entropy = b["entropy"].clone().requires_grad_(True) if "entropy" in terms else None
    loss, sums = loss_fn(LossInputs(logp, b["old"], b["adv"], pg_w, b["mask"],
                                    hkl_weight=hkl_w if "hinge" in terms else None,
                                    ref_logp=b["ref"] if "kl" in terms else None,
                                    rollout_logp=b["rollout"] if "tis" in terms else None, entropy=entropy,
                                    behaviour_mask=b["behaviour"] if "mask" in terms else None), settings)
    loss.backward()
    return loss.detach(), logp.grad, None if entropy is None else entropy.grad, sums


@pytest.mark.parametrize("dtype, tol", [(torch.float64, dict(rtol=1e-12, atol=1e-15)),
                                        (torch.float32, dict(rtol=2e-5, atol=1e-7))], ids=["float64", "float32"])
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
@pytest.mark.parametrize("terms", list(TERMS))
def test_fused_loss_equals_literal_definition(terms, ratio_level, dtype, tol):
    used, kw = TERMS[terms]
    widths = dict(clip_low=3e-4, clip_high=4e-4) if ratio_level == "sequence" else {}  # GSPO's
    settings = LossSettings(ratio_level=ratio_level, **widths, **kw)
    clip_counts = ("pg_clipped_high", "pg_clipped_low") + (
        ("dual_clipped",) if ratio_level == "token" and settings.clip_c is not None else ())
    for mode in LOSS_AGG_MODES:
        for pad in (0.0, float("nan")):
            b = make_batch(dtype, pad)
            fused = run(policy_loss, b, mode, used, settings)
            literal = run(literal_policy_loss, b, mode, used, settings)
            where = f"{mode}, padding {pad}"
            assert literal[0].dtype == fused[0].dtype == dtype and literal[1].dtype == dtype
            torch.testing.assert_close(literal[0], fused[0], **tol, msg=lambda m: f"loss, {where}: {m}")
            torch.testing.assert_close(literal[1], fused[1], **tol, msg=lambda m: f"logp grad, {where}: {m}")
            if "entropy" in used:
                torch.testing.assert_close(literal[2], fused[2], **tol, msg=lambda m: f"entropy grad, {where}: {m}")
            assert set(literal[3]) == set(fused[3]), where
            for key, value in fused[3].items():
                torch.testing.assert_close(literal[3][key].double(), value.double(), **tol,
                                           msg=lambda m: f"{key}, {where}: {m}")
            assert all(float(fused[3][k]) > 0 for k in clip_counts), where  # every clip bound acts somewhere


def test_loss_benchmark_compares_the_two_implementations(capsys, monkeypatch):
    """bench/bench_losses.py --vs-literal at a tiny size: the fused path keeps exactly one [B, T] float32 gradient
    for the backward pass, the literal one several; the table runs and is headed by the machine."""
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_losses
    b = bench_losses.make_batch(512, 16, 8, 0.5, seed=0)
    elements = b["mask"].numel()
    assert bench_losses.saved_for_backward_bytes(b, "fused") == 4 * elements
    assert bench_losses.saved_for_backward_bytes(b, "literal") > 4 * 4 * elements
    assert bench_losses.main(["--vs-literal", "--tokens", "512", "--seqs", "16", "--group-size", "8",
                              "--mastered-frac", "1", "--repeats", "1", "--warmup", "0", "--threads", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:4] == ["mastered", "B", "x", "T"])
    assert lines[header - 1].startswith("machine: CPU")
    assert lines[header + 2].split()[:4] == ["1.00", "16", "x", str(b["T"])]


def test_loss_benchmark_on_a_gpu_times_and_measures_with_cuda(monkeypatch, capsys):
    """--device cuda with CUDA mocked (the tensors stay on the CPU): the timing synchronises the device on both
    sides, the peak is the CUDA allocator's, and without a GPU the option is refused naming it."""
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_losses

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 1000)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 5000)
    b = bench_losses.make_batch(512, 16, 8, 0.5, seed=0)
    assert bench_losses.run_impl(b, "literal", torch.device("cuda")) > 0 and calls == ["sync", "sync"]
    calls.clear()
    assert bench_losses.peak_bytes(b, "fused", torch.device("cuda")) == 4000
    assert calls == ["sync", "reset", "sync", "sync", "sync"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        bench_losses.main(["--vs-literal", "--device", "cuda"])
    assert "--device=cuda: this machine has no CUDA device; use --device=cpu" in capsys.readouterr().err
