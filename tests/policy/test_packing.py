"""Packed (THD) micro-batches, bins and the Karmarkar-Karp balance (single process)."""

import pytest
import torch

from mcpo_megatron.models.batch import SequenceBatch, make_microbatch
from mcpo_megatron.models.packing import (
    balanced_partition,
    make_packed_microbatch,
    pack_bins,
    packed_filler,
    packed_microbatches,
    pad_packed_count,
    sequence_cost,
)


def _batch(prompt_lens, response_lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(1, 50, (p + r,), generator=g) for p, r in zip(prompt_lens, response_lens)]
    return SequenceBatch(
        input_ids=ids, prompt_lens=torch.tensor(prompt_lens), response_lens=torch.tensor(response_lens),
        token_fields={"old_logp": [torch.randn(r, generator=g) for r in response_lens]},
        seq_fields={"mastered": torch.arange(len(ids)) % 2 == 0},
    )


def test_packed_row_layout_boundaries_positions_and_response_index():
    batch = _batch([3, 2, 4], [4, 0, 1])
    mb = make_packed_microbatch(batch, [0, 1, 2])
    assert mb.input_ids.shape == (1, 14)
    assert torch.equal(mb.input_ids[0], torch.cat(batch.input_ids))
    assert mb.packing.cu_seqlens.tolist() == [0, 7, 9, 14] and mb.packing.cu_seqlens.dtype == torch.int32
    assert mb.packing.cu_seqlens_padded.tolist() == [0, 7, 9, 14] and mb.packing.max_seqlen == 7
    assert mb.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 1, 0, 1, 2, 3, 4]  # restart per sequence
    # response token j of a sequence at offset o is predicted at o + prompt_len + j - 1
    assert mb.resp_index.tolist() == [[2, 3, 4, 5], [0, 0, 0, 0], [12, 0, 0, 0]]
    assert mb.mask.tolist() == [[True] * 4, [False] * 4, [True, False, False, False]]
    assert torch.equal(mb.targets[0], batch.input_ids[0][3:]) and int(mb.targets[2, 0]) == int(batch.input_ids[2][4])
    assert torch.equal(mb.token_fields["old_logp"][0], batch.token_fields["old_logp"][0])
    assert mb.token_mask().all() and mb.seq_length == 14


def test_packed_response_side_equals_the_padded_micro_batch():
    """Loss terms and denominators read [b, T] blocks: packing changes only where resp_index points."""
    batch = _batch([3, 5, 2], [6, 2, 0])
    packed, padded = make_packed_microbatch(batch, [1, 0, 2]), make_microbatch(batch, [1, 0, 2])
    for name in ("targets", "mask", "prompt_lens", "response_lens"):
        assert torch.equal(getattr(packed, name), getattr(padded, name)), name
    assert torch.equal(packed.token_fields["old_logp"], padded.token_fields["old_logp"])
    assert torch.equal(packed.seq_fields["mastered"], padded.seq_fields["mastered"])
    assert packed.num_response_tokens == padded.num_response_tokens


def test_sequence_and_row_padding_form_their_own_segments():
    batch = _batch([3, 2], [2, 3])  # 5 and 5 tokens
    mb = make_packed_microbatch(batch, [0, 1], seq_multiple=4, total_multiple=3)
    # each sequence padded to 8, the row to 18: a two-token padding segment at the end
    assert mb.packing.cu_seqlens.tolist() == [0, 5, 10, 12]
    assert mb.packing.cu_seqlens_padded.tolist() == [0, 8, 16, 18]
    assert mb.input_ids.shape == (1, 18) and mb.packing.max_seqlen == 8
    assert mb.token_mask()[0].tolist() == [True] * 5 + [False] * 3 + [True] * 5 + [False] * 5
    assert mb.resp_index[1].tolist() == [9, 10, 11]  # the second sequence starts at its padded offset 8
    assert mb.position_ids[0, 8:18].tolist() == list(range(8)) + [0, 1]


def test_zero_length_sequence_takes_no_segment():
    batch = SequenceBatch(input_ids=[torch.tensor([5, 6, 7]), torch.zeros(0, dtype=torch.long)],
                          prompt_lens=torch.tensor([2, 0]), response_lens=torch.tensor([1, 0]))
    mb = make_packed_microbatch(batch, [0, 1])
    assert mb.packing.cu_seqlens.tolist() == [0, 3] and mb.indices == [0, 1]
    assert not mb.mask[1].any()


def test_filler_is_padding_only_and_returns_nothing():
    f = packed_filler(6, response_width=3)
    assert f.filler and f.indices == [] and f.input_ids.shape == (1, 6) and f.mask.shape == (1, 3)
    assert f.packing.cu_seqlens.tolist() == [0, 6] and not f.token_mask().any() and not f.mask.any()


def test_pack_bins_first_fit_decreasing_whole_sequences():
    lengths = [5, 17, 3, 9, 9, 30, 1, 12]
    bins = pack_bins(lengths, 20)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 20 or len(b) == 1 for b in bins)
    assert [5] in bins  # longer than the budget: a bin of its own
    assert bins == pack_bins(lengths, 20)
    # first-fit decreasing: 30 | 17+3 | 12+5+1... and a bin whose longest sequence outweighs the rest together
    assert bins[1] == [1, 2] and 2 * 17 > 17 + 3
    assert len(bins) <= len(lengths) and sum(len(b) for b in bins) == len(lengths)


def test_pack_bins_counts_padding_to_the_sequence_multiple():
    assert pack_bins([5, 5, 5], 16, seq_multiple=4) == [[0, 1], [2]]  # 8 + 8 fit, a third 8 does not
    with pytest.raises(ValueError, match="max_tokens_per_microbatch=0"):
        pack_bins([3], 0)


def _spread(costs, sets):
    sums = [sum(costs[i] for i in s) for s in sets]
    return max(sums) - min(sums)


@pytest.mark.parametrize("costs,parts,spread", [([8, 7, 6, 5, 4], 2, 2), ([4, 5, 6, 7, 8], 3, 3),
                                                ([10, 1, 1, 1], 2, 7), ([3, 3, 2, 2, 2], 2, 2), ([1, 2], 4, 2)])
def test_balanced_partition_is_karmarkar_karp(costs, parts, spread):
    sets = balanced_partition(costs, parts)
    assert len(sets) == parts and sorted(i for s in sets for i in s) == list(range(len(costs)))
    sums = [sum(costs[i] for i in s) for s in sets]
    assert sums == sorted(sums, reverse=True)
    assert _spread(costs, sets) == spread  # largest differencing's result, worked by hand
    assert sets == balanced_partition(costs, parts)


def test_balanced_partition_beats_greedy_on_long_tailed_lengths():
    from mcpo_megatron.trainer.step_data import assign_to_ranks

    g = torch.Generator().manual_seed(0)
    kk_total = greedy_total = 0
    for _ in range(50):
        lengths = torch.exp(7.0 + torch.randn(32, generator=g)).clamp(max=20_480).long().tolist()
        kk_total += _spread(lengths, balanced_partition(lengths, 4))
        greedy_total += _spread(lengths, assign_to_ranks(lengths, 4))
    assert kk_total < greedy_total


def test_balanced_partition_beats_greedy_on_a_known_case():
    from mcpo_megatron.trainer.step_data import assign_to_ranks

    costs = [8, 7, 6, 5, 4]  # greedy longest-first: 8+5+4=17 vs 7+6=13; KK: 8+6=14 vs 7+5+4=16
    assert _spread(costs, assign_to_ranks(costs, 2)) == 4 and _spread(costs, balanced_partition(costs, 2)) == 2


def test_sequence_cost_tokens_and_flops():
    assert sequence_cost(20_480, "tokens") == 20_480
    assert sequence_cost(20_480, "flops") == 20_480 + 20_480 ** 2 // (12 * 4096)
    assert sequence_cost(100, "flops") == 100  # short sequences: the dense layers dominate
    with pytest.raises(ValueError, match="trainer.packing_balance='x'"):
        sequence_cost(1, "x")


def test_fixed_shape_bins_share_one_length_and_a_multiple_of_pp():
    batch = _batch([3, 6, 2, 8, 5], [9, 4, 7, 0, 10])
    mbs = packed_microbatches(batch, 20, fixed_shape=True, num_multiple=2, total_multiple=2)
    assert len(mbs) % 2 == 0
    assert len({mb.input_ids.shape for mb in mbs}) == 1 and len({mb.mask.shape[1] for mb in mbs}) == 1
    assert mbs[0].seq_length % 2 == 0
    real = [mb for mb in mbs if not mb.filler]
    assert sorted(i for mb in real for i in mb.indices) == list(range(5))
    padded = pad_packed_count(mbs, len(mbs) + 1, fixed_shape=True)
    assert padded[-1].filler and padded[-1].input_ids.shape == mbs[0].input_ids.shape
    assert pad_packed_count(real, len(real) + 2, total_multiple=2)[-1].input_ids.shape == (1, 2)
    with pytest.raises(ValueError, match="count=0"):
        pad_packed_count(real, 0)


def test_packed_layout_moves_with_the_micro_batch_and_gives_megatron_int32_lengths():
    """On GPUs the lengths must sit on the GPU as int32 (Transformer Engine's THD kernels read them there)."""
    mb = make_packed_microbatch(_batch([3, 2], [2, 3]), [0, 1], seq_multiple=4, total_multiple=3)
    moved = mb.to(torch.device("meta"))
    assert moved.packing.cu_seqlens.device.type == moved.packing.token_mask.device.type == "meta"
    assert moved.packing.cu_seqlens_padded.device.type == moved.input_ids.device.type == "meta"
    params = mb.packing.packed_seq_params()
    assert params.qkv_format == "thd" and params.cu_seqlens_q.dtype == params.cu_seqlens_kv_padded.dtype == torch.int32
    assert params.max_seqlen_q == params.max_seqlen_kv == 8 and params.cp_group is None
    assert torch.equal(params.cu_seqlens_q_padded, mb.packing.cu_seqlens_padded)
