"""The output layer on the scored positions only: the selection against a loop over sequences, and the hook's
life cycle (one call per scoring, the layer untouched outside it, the sequence-parallel flag restored).

Its numbers inside megatron's models (TP with and without sequence parallelism, PP, VPP, packing, CP, MoE, tied
embeddings) are checked against transformers and float64 references by the policy parity suites."""

import pytest
import torch

from mcpo_megatron.models.scored_positions import ScoredOutputLayer, select_scored_positions


def _loop_selection(hidden, resp_index):
    rows = hidden.shape[1]
    out = [hidden[int(p), (i if rows > 1 else 0)] for i in range(resp_index.shape[0]) for p in resp_index[i]]
    return torch.stack(out).unsqueeze(1)


@pytest.mark.parametrize("rows", [3, 1], ids=["padded", "packed"])
def test_selection_matches_a_loop_over_sequences_forward_and_backward(rows):
    g = torch.Generator().manual_seed(0)
    s, b, t, h = 11, 3, 4, 5
    hidden = torch.randn(s, rows, h, dtype=torch.float64, generator=g, requires_grad=True)
    resp_index = torch.randint(0, s, (b, t), generator=g)
    resp_index[1, 2:] = 0  # padding positions point at 0, as MicroBatch's do
    got = select_scored_positions(hidden, resp_index)
    want = _loop_selection(hidden, resp_index)
    assert got.shape == (b * t, 1, h)
    assert torch.equal(got, want)
    w = torch.randn(b * t, 1, h, dtype=torch.float64, generator=g)
    (g_got,) = torch.autograd.grad((got * w).sum(), hidden)
    (g_want,) = torch.autograd.grad((want * w).sum(), hidden)
    assert torch.allclose(g_got, g_want, rtol=0, atol=1e-15)


def test_selection_refuses_a_row_count_that_is_neither_b_nor_packed():
    with pytest.raises(ValueError, match="2 rows for 3 sequences"):
        select_scored_positions(torch.zeros(5, 2, 4), torch.zeros(3, 2, dtype=torch.long))


class _OutputLayer(torch.nn.Module):
    """Called like megatron's ColumnParallelLinear: (hidden, weight=...) -> (logits, bias)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(7, 4, dtype=torch.float64))
        self.sequence_parallel = False
        self.seen_shapes = []

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        self.seen_shapes.append(tuple(hidden.shape))
        return hidden @ (self.weight if weight is None else weight).t(), None


class _Chunk(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.output_layer = _OutputLayer()

    def forward(self, hidden):
        return self.output_layer(hidden, weight=None)[0].transpose(0, 1).contiguous()


def test_hook_scores_one_call_per_scoring_and_leaves_other_calls_alone():
    chunk = _Chunk()
    scored = ScoredOutputLayer(chunk, tp_group=None)
    hidden = torch.randn(6, 2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    resp_index = torch.tensor([[2, 3, 4], [1, 0, 0]])
    full = chunk(hidden)  # [b, S, V]
    with scored.scoring(resp_index):
        logits = chunk(hidden)
        again = chunk(hidden)  # a second call inside the same scoring is not scored
    assert logits.shape == (1, 6, 7) and again.shape == (2, 6, 7)
    want = torch.stack([full[i, resp_index[i]] for i in range(2)])  # [b, T, V]
    # the product runs on another shape, so BLAS may round the last bit differently
    assert torch.allclose(logits.view(2, 3, 7), want, rtol=0, atol=1e-13)
    assert chunk.output_layer.seen_shapes == [(6, 2, 4), (6, 1, 4), (6, 2, 4)]
    assert torch.equal(chunk(hidden), full)


def test_sequence_parallel_flag_and_selection_are_reset_when_the_forward_fails():
    chunk = _Chunk()
    chunk.output_layer.sequence_parallel = True
    scored = ScoredOutputLayer(chunk, tp_group=None)
    with pytest.raises(RuntimeError, match="boom"):
        with scored.scoring(torch.zeros(2, 1, dtype=torch.long)):
            chunk.output_layer.sequence_parallel = False  # as the pre-hook leaves it for its one call
            raise RuntimeError("boom")
    assert chunk.output_layer.sequence_parallel is True and scored.resp_index is None


def test_passes_refuse_an_output_layer_other_than_megatrons_column_parallel_linear():
    from mcpo_megatron.models.passes import PipelinePasses

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.module = _Chunk()
            self.module.post_process = True

    passes = PipelinePasses()
    passes.ddps = [Wrapped()]
    with pytest.raises(NotImplementedError, match="_OutputLayer; the log-prob passes run megatron's Column"):
        passes._score_response_positions_only()
