"""SequenceBatch / MicroBatch padding and the token-budget split (single process)."""

import pytest
import torch

from mcpo_megatron.models.batch import (
    SequenceBatch,
    make_microbatches,
    pad_to_multiple,
    split_by_token_budget,
    unpad_response,
)


def _batch(prompt_lens, response_lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(1, 50, (p + r,), generator=g) for p, r in zip(prompt_lens, response_lens)]
    return SequenceBatch(
        input_ids=ids,
        prompt_lens=torch.tensor(prompt_lens),
        response_lens=torch.tensor(response_lens),
        token_fields={"old_logp": [torch.randn(r, generator=g) for r in response_lens]},
        seq_fields={"mastered": torch.arange(len(ids)) % 2 == 0},
    )


def test_split_respects_budget_and_covers_every_index():
    lengths = [5, 17, 3, 9, 9, 30, 1, 12]
    groups = split_by_token_budget(lengths, 32)
    flat = sorted(i for g in groups for i in g)
    assert flat == list(range(len(lengths)))
    for g in groups:
        s_max = max(lengths[i] for i in g)
        assert len(g) * s_max <= 32 or len(g) == 1
    # longest first, ties by index
    assert groups[0] == [5]
    assert [i for g in groups for i in g] == sorted(range(8), key=lambda i: (-lengths[i], i))
    assert split_by_token_budget(lengths, 32) == groups


def test_split_oversized_sequence_is_alone_and_huge_budget_is_one_group():
    lengths = [100, 4, 4]
    assert split_by_token_budget(lengths, 10) == [[0], [1, 2]]
    assert split_by_token_budget(lengths, 10_000) == [[0, 1, 2]]


def test_split_rejects_bad_budget():
    with pytest.raises(ValueError, match="max_tokens_per_microbatch"):
        split_by_token_budget([3, 4], 0)


def test_microbatch_padding_and_positions():
    b = _batch([3, 2, 4], [4, 0, 2])
    (mb,) = make_microbatches(b, 1000)
    assert mb.indices == [0, 2, 1]
    assert mb.input_ids.shape == (3, 7)
    assert mb.mask.tolist() == [[True] * 4, [True, True, False, False], [False] * 4]
    for row, i in enumerate(mb.indices):
        p, r = int(b.prompt_lens[i]), int(b.response_lens[i])
        full = b.input_ids[i]
        assert torch.equal(mb.input_ids[row, : p + r], full)
        assert (mb.input_ids[row, p + r :] == 0).all()
        for j in range(r):
            # token j is predicted from position p + j - 1 and is the token at p + j
            assert int(mb.resp_index[row, j]) == p + j - 1
            assert int(mb.targets[row, j]) == int(full[p + j])
        assert torch.equal(mb.token_fields["old_logp"][row, :r], b.token_fields["old_logp"][i])
        assert bool(mb.seq_fields["mastered"][row]) == bool(b.seq_fields["mastered"][i])
    per_seq = unpad_response(mb.token_fields["old_logp"], mb)
    assert [t.numel() for t in per_seq] == [4, 2, 0]
    assert mb.num_response_tokens == 6


def test_seq_multiple_and_validation_errors():
    b = _batch([3, 2], [2, 1])
    (mb,) = make_microbatches(b, 1000, seq_multiple=4)
    assert mb.seq_length == 8 and pad_to_multiple(5, 4) == 8
    bad = _batch([3, 2], [2, 1])
    bad.token_fields["old_logp"][1] = torch.zeros(5)
    with pytest.raises(ValueError, match="old_logp"):
        bad.validate()
    bad = _batch([0, 2], [2, 1])
    with pytest.raises(ValueError, match="prompt_lens"):
        bad.validate()



def test_token_ids_outside_the_vocabulary_are_refused_on_the_host():
    """Checked before the ids reach the device (vocab_parallel_logprobs does not read device ids), by every pass."""
    import re
    from types import SimpleNamespace

    from mcpo_megatron.models.passes import PipelinePasses

    _batch([3, 2], [2, 4]).check_token_ids(50)
    for bad, span in ((50, ", 50] but"), (-1, "span [-1, ")):
        wrong = _batch([3, 2], [2, 4])
        wrong.input_ids[1][4] = bad
        with pytest.raises(ValueError, match=re.escape(span)):
            wrong.check_token_ids(50)
        passes = SimpleNamespace(vocab_size=50)  # the check comes first: nothing else of the policy is read
        with pytest.raises(ValueError, match="but the model's vocabulary has 50 entries"):
            PipelinePasses._microbatches(passes, wrong)
