"""Context parallelism's split of packed micro-batches, against a plain implementation (single process)."""

import pytest
import torch

from mcpo_megatron.models.batch import SequenceBatch
from mcpo_megatron.models.context_parallel import local_positions, split_for_cp_rank
from mcpo_megatron.models.packing import make_packed_microbatch
from mcpo_megatron.parallel.context_split import cp_chunk_positions


def plain_split(x: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """megatron's load-balanced split of one sequence, written the obvious way: 2 x cp chunks, keep r and 2cp-1-r."""
    chunks = x.chunk(2 * cp)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]])


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_chunk_positions_match_the_plain_split(cp):
    n = 8 * cp
    seen = []
    for rank in range(cp):
        got = cp_chunk_positions(n, cp, rank)
        assert torch.equal(got, plain_split(torch.arange(n), cp, rank))
        seen += got.tolist()
    assert sorted(seen) == list(range(n))  # every position on exactly one rank


def test_chunk_positions_refuse_a_length_that_is_not_a_multiple_of_2cp():
    with pytest.raises(ValueError, match="10 padded tokens is not a multiple of 2 x CP = 4"):
        cp_chunk_positions(10, 2, 0)


def _batch(prompt_lens, response_lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(1, 50, (p + r,), generator=g) for p, r in zip(prompt_lens, response_lens)]
    return SequenceBatch(input_ids=ids, prompt_lens=torch.tensor(prompt_lens),
                         response_lens=torch.tensor(response_lens),
                         token_fields={"w": [torch.rand(r, generator=g) + 0.5 for r in response_lens]},
                         seq_fields={"advantage": torch.randn(len(ids), generator=g)})


@pytest.mark.parametrize("cp", [2, 3])
def test_split_of_a_packed_bin_is_the_plain_split_of_each_sequence(cp):
    # lengths 7, 5, 13 and an empty response: none a multiple of 2 x CP
    batch = _batch([3, 5, 4], [4, 0, 9])
    mb = make_packed_microbatch(batch, [0, 1, 2], seq_multiple=2 * cp, total_multiple=2 * cp)
    bounds = mb.packing.cu_seqlens_padded.tolist()
    owned = torch.zeros_like(mb.mask, dtype=torch.long)
    fields = torch.zeros_like(mb.token_fields["w"])
    for rank in range(cp):
        part = split_for_cp_rank(mb, cp, rank)
        expected = torch.cat([plain_split(mb.input_ids[0, s:e], cp, rank) for s, e in zip(bounds[:-1], bounds[1:])])
        assert torch.equal(part.input_ids[0], expected)
        assert part.seq_length * cp == mb.seq_length
        assert torch.equal(part.packing.cu_seqlens_padded, mb.packing.cu_seqlens_padded)  # whole-sequence lengths
        # positions restart per sequence and follow the tokens
        assert torch.equal(part.position_ids[0], torch.cat([plain_split(mb.position_ids[0, s:e], cp, rank)
                                                            for s, e in zip(bounds[:-1], bounds[1:])]))
        # a response token held here is predicted at the same token as in the whole row
        mine = local_positions(mb.packing.cu_seqlens_padded, cp, rank)
        assert torch.equal(mine[part.resp_index][part.mask], mb.resp_index[part.mask])
        assert torch.equal(part.input_ids[0][part.resp_index][part.mask],
                           mb.input_ids[0][mb.resp_index][part.mask])
        assert (part.token_fields["w"][~part.mask] == 0).all() and (part.targets[~part.mask] == 0).all()
        owned += part.mask.long()
        fields += part.token_fields["w"]
    assert torch.equal(owned, mb.mask.long())  # every response token on exactly one CP rank
    assert torch.equal(fields, mb.token_fields["w"])  # weights split, their sum over CP unchanged


def test_split_needs_a_packed_micro_batch():
    from mcpo_megatron.models.batch import make_microbatch

    with pytest.raises(ValueError, match="trainer.sequence_packing=true"):
        split_for_cp_rank(make_microbatch(_batch([2], [2]), [0]), 2, 0)


def test_a_sequence_split_over_cp_ranks_is_counted_once():
    batch = _batch([3, 5, 4], [4, 0, 9])
    mb = make_packed_microbatch(batch, [0, 1, 2], seq_multiple=4, total_multiple=4)
    parts = [split_for_cp_rank(mb, 2, r) for r in range(2)]
    assert all((p.mask.any(-1) & ~mb.mask.any(-1)).sum() == 0 for p in parts)
    assert sum(p.mask.any(-1).long() for p in parts).max() == 2  # a response on both ranks...
    counted = sum(p.counted_rows.long() for p in parts)
    assert counted[mb.response_lens > 0].tolist() == [1, 1]  # ...is counted on one of them
