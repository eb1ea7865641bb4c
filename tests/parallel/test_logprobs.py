"""vocab_parallel_logprobs in one process against a float64 torch.log_softmax reference."""

import pytest
import torch

from host_syncs import HostReads
from mcpo_megatron.parallel.logprobs import vocab_parallel_logprobs


def reference(logits, targets, temperature=1.0):
    """Plain full-vocabulary float64 log-probs and entropy."""
    logp_all = torch.log_softmax(logits.double() / temperature, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def make(shape, vocab, seed=0, dtype=torch.float32, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=g, dtype=torch.float64) * scale).to(dtype)
    targets = torch.randint(0, vocab, shape, generator=g)
    return logits, targets


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("chunk_size", [1, 3, 7, 4096])
def test_values_match_float64_reference(temperature, chunk_size):
    logits, targets = make((4, 5), 50, seed=1)
    logp, ent = vocab_parallel_logprobs(logits, targets, None, chunk_size=chunk_size,
                                        temperature=temperature)
    ref_logp, ref_ent = reference(logits, targets, temperature)
    assert logp.shape == targets.shape and logp.dtype == torch.float32
    torch.testing.assert_close(logp.double(), ref_logp, rtol=0, atol=2e-6)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=2e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk_size", [2, 5, 64])
def test_gradcheck_float64(temperature, chunk_size):
    logits, targets = make((7,), 11, seed=2, dtype=torch.float64, scale=1.0)
    logits.requires_grad_(True)

    def f(x):
        return vocab_parallel_logprobs(x, targets, None, chunk_size=chunk_size,
                                       temperature=temperature)

    assert torch.autograd.gradcheck(f, (logits,), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.8])  # at 1 the kernel reads the logits without a copy
@pytest.mark.parametrize("compute_entropy", [True, False])
@pytest.mark.parametrize("inplace", [False, True])
def test_gradient_matches_reference_fp32(compute_entropy, inplace, temperature):
    logits, targets = make((3, 10), 97, seed=3)
    g = torch.Generator().manual_seed(4)
    w_lp, w_h = torch.randn(3, 10, generator=g), torch.randn(3, 10, generator=g)

    x = logits.clone().requires_grad_(True)
    y = x * 1.0  # a non-leaf, like the output layer's logits (in-place needs a non-leaf)
    logp, ent = vocab_parallel_logprobs(y, targets, None, chunk_size=7, temperature=temperature,
                                        compute_entropy=compute_entropy, inplace_backward=inplace)
    loss = (w_lp * logp).sum() + ((w_h * ent).sum() if compute_entropy else 0)
    loss.backward()

    xr = logits.double().requires_grad_(True)
    rl, re = reference(xr, targets, temperature)
    ((w_lp.double() * rl).sum() + ((w_h.double() * re).sum() if compute_entropy else 0)).backward()
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=0, atol=1e-6)
    if not compute_entropy:
        assert ent is None


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_entropy_kept_for_its_metric_leaves_the_gradient_that_of_the_log_probs(temperature):
    logits, targets = make((4, 6), 53, seed=8)
    w = torch.randn(4, 6, generator=torch.Generator().manual_seed(9))
    grads = []
    for compute_entropy in (True, False):
        x = logits.clone().requires_grad_(True)
        logp, ent = vocab_parallel_logprobs(x * 1.0, targets, None, chunk_size=5, temperature=temperature,
                                            compute_entropy=compute_entropy, inplace_backward=True)
        metric = ent.detach().sum() if compute_entropy else None  # as the loss keeps it with entropy_coeff 0
        (w * logp).sum().backward()
        grads.append(x.grad)
    assert metric is None and torch.equal(grads[0], grads[1])
    xr = logits.double().requires_grad_(True)
    (w.double() * reference(xr, targets, temperature)[0]).sum().backward()
    torch.testing.assert_close(grads[0].double(), xr.grad, rtol=0, atol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_bf16_gradient_is_the_fp32_computation_of_the_same_values(temperature):
    logits, targets = make((5, 4), 64, seed=10, dtype=torch.bfloat16)
    w_lp, w_h = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(11))
    x = logits.clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(x * 1, targets, None, chunk_size=3, temperature=temperature)
    ((w_lp * lp).sum() + (w_h * ent).sum()).backward()
    xr = logits.double().requires_grad_(True)
    rl, re = reference(xr, targets, temperature)
    ((w_lp.double() * rl).sum() + (w_h.double() * re).sum()).backward()
    torch.testing.assert_close(lp.double(), rl, rtol=0, atol=2e-6)
    # the gradient computed in fp32, then rounded once to bf16
    torch.testing.assert_close(x.grad.double(), xr.grad.to(torch.bfloat16).double(), rtol=2 ** -7, atol=1e-6)


def test_bf16_input_computes_in_fp32():
    logits, targets = make((6, 4), 64, seed=5, dtype=torch.bfloat16)
    logp, ent = vocab_parallel_logprobs(logits, targets, None, chunk_size=5)
    ref_logp, ref_ent = reference(logits.float(), targets)  # same bf16 values, exact math
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp.double(), ref_logp, rtol=0, atol=2e-6)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=2e-6)
    x = logits.clone().requires_grad_(True)
    lp, _ = vocab_parallel_logprobs(x, targets, None)
    lp.sum().backward()
    assert x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad.float()).all()


def test_extreme_logits_stay_finite():
    logits, targets = make((8,), 30, seed=6, scale=1e4)
    logp, ent = vocab_parallel_logprobs(logits, targets, None, chunk_size=3)
    ref_logp, ref_ent = reference(logits, targets)
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all()
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-6, atol=1e-3)


def test_bad_inputs_name_the_problem():
    logits, targets = make((4,), 10)
    with pytest.raises(ValueError, match="target ids span"):
        vocab_parallel_logprobs(logits, targets + 10, None)
    with pytest.raises(ValueError, match="shape"):
        vocab_parallel_logprobs(logits, targets[:2], None)
    with pytest.raises(ValueError, match="chunk_size"):
        vocab_parallel_logprobs(logits, targets, None, chunk_size=0)
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs(logits, targets, None, temperature=0.0)
    with pytest.raises(ValueError, match="int64"):
        vocab_parallel_logprobs(logits, targets.float(), None)


@pytest.mark.parametrize("compute_entropy", [True, False])
def test_no_host_sync_in_forward_or_backward(compute_entropy):
    """On the meta device (no values: reading one raises, as a sync of a GPU would show) the forward and backward
    run through with no read of a tensor into Python; the ids are range-checked where they are built, on the host
    (tests/policy/test_batch.py)."""
    logits = torch.empty(12, 10, device="meta", requires_grad=True)
    targets = torch.empty(12, dtype=torch.long, device="meta")
    with HostReads() as host:
        logp, ent = vocab_parallel_logprobs(logits * 1.0, targets, None, chunk_size=5,
                                            compute_entropy=compute_entropy, inplace_backward=True)
        loss = logp.sum() + (ent.sum() if compute_entropy else 0.0)
        (grad,) = torch.autograd.grad(loss, logits)
    assert host.reads == [] and grad.shape == logits.shape and grad.device.type == "meta"


class _AllocationRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the byte size of every new storage an aten op returns."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        seen = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                if isinstance(a, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.sizes.append(t.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("inplace", [False, True])
def test_no_full_vocab_work_tensors(inplace):
    """Forward allocates at most [chunk, V] buffers; backward adds only the gradient itself."""
    n, vocab, chunk = 64, 256, 8
    logits, targets = make((n,), vocab, seed=7)
    x = logits.clone().requires_grad_(True)
    y = x * 1.0
    chunk_bytes, full_bytes = chunk * vocab * 4, n * vocab * 4

    fwd = _AllocationRecorder()
    with fwd:
        logp, ent = vocab_parallel_logprobs(y, targets, None, chunk_size=chunk,
                                            inplace_backward=inplace)
    assert fwd.sizes and max(fwd.sizes) <= chunk_bytes

    bwd = _AllocationRecorder()
    with bwd:
        torch.autograd.grad((logp.sum() + ent.sum()), y)
    big = [s for s in bwd.sizes if s > chunk_bytes]
    # The gradient w.r.t. the shard is the only [N, V] allocation (none when written in place).
    assert big == ([] if inplace else [full_bytes])
