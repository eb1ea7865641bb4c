"""The local layer spec's reference attention (parallel/cpu_attention.py) keeps everything on the queries' device.

A GPU without Transformer Engine runs the local layer spec (``model.transformer_impl=auto``), so with packed
sequences the reference attention gets CUDA queries; positions and causal masks it built on the CPU failed the first
packed forward there. Here the queries, keys and values live on the meta device (shapes without data, any device but
the CPU shows the fault) and every tensor handed to the attention kernel must be there too, at CP = 1 and CP = 2. The
cumulative sequence lengths stay on the CPU: the attention reads them as Python integers, which a meta tensor has
not. CP = 2 runs in this one process: a stand-in CP group of 2 whose other rank holds the same keys and values.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mcpo_megatron.parallel import cpu_attention

HEADS, GROUPS, HEAD_DIM = 4, 2, 8
LENGTHS = [8, 4, 12]  # padded sequence lengths: multiples of 2 x CP for CP = 2


class _Group:
    """A process group stand-in of ``n`` ranks (this process is rank 0)."""

    def __init__(self, n: int):
        self.n = n

    def size(self) -> int:
        return self.n


def _attention(cp: int):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, kv_channels=HEAD_DIM, context_parallel_size=cp,
                               use_cpu_initialization=True)
    attention = cpu_attention.ReferenceDotProductAttention(config, layer_number=1,
                                                           attn_mask_type=AttnMaskType.causal, attention_type="self",
                                                           pg_collection=SimpleNamespace(tp=_Group(1)))
    return attention.eval()


def _packed_params(cp_group):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist(), dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                           cu_seqlens_kv_padded=cu, max_seqlen_q=max(LENGTHS), max_seqlen_kv=max(LENGTHS),
                           cp_group=cp_group)


@pytest.mark.parametrize("cp", [1, 2])
def test_packed_attention_builds_positions_and_masks_on_the_query_device(cp, monkeypatch):
    handed = []
    kernel = cpu_attention._causal_attention

    def recording_kernel(q, k, v, q_pos, k_pos, scale, dropout=None):
        handed.append({"q": q, "k": k, "v": v, "q_pos": q_pos, "k_pos": k_pos})
        return kernel(q, k, v, q_pos, k_pos, scale, dropout)

    monkeypatch.setattr(cpu_attention, "_causal_attention", recording_kernel)
    cp_group = None
    if cp > 1:
        cp_group = _Group(cp)
        monkeypatch.setattr(cpu_attention.dist, "get_world_size", lambda group=None: group.size())
        monkeypatch.setattr(cpu_attention.dist, "get_rank", lambda group=None: 0)
        monkeypatch.setattr(cpu_attention._GatherOverGroup, "apply",
                            staticmethod(lambda x, group: torch.stack([x] * group.size())))

    tokens = sum(LENGTHS) // cp  # this rank's share of the packed row
    query = torch.empty(tokens, HEADS, HEAD_DIM, device="meta")
    key = torch.empty(tokens, GROUPS, HEAD_DIM, device="meta")
    value = torch.empty(tokens, GROUPS, HEAD_DIM, device="meta")
    out = _attention(cp)(query, key, value, None, packed_seq_params=_packed_params(cp_group))

    assert out.device.type == "meta" and tuple(out.shape) == (tokens, HEADS * HEAD_DIM)
    assert len(handed) == len(LENGTHS)  # one call per sequence
    for call, n in zip(handed, LENGTHS):
        misplaced = {name: t.device.type for name, t in call.items() if t.device.type != "meta"}
        assert not misplaced, f"tensors handed to attention off the queries' device: {misplaced}"
        # this rank's queries over the whole sequence's keys, positions to match
        assert tuple(call["q"].shape) == (n // cp, HEADS, HEAD_DIM) and tuple(call["q_pos"].shape) == (n // cp,)
        assert tuple(call["k"].shape) == (n, HEADS, HEAD_DIM) and tuple(call["k_pos"].shape) == (n,)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_chunk_positions_are_made_on_the_device_asked_for(device):
    from mcpo_megatron.parallel.context_split import cp_chunk_positions

    got = cp_chunk_positions(8, 2, 1, device=device)
    assert got.device.type == device and tuple(got.shape) == (4,)
    if device == "cpu":
        assert got.tolist() == [2, 3, 4, 5]
