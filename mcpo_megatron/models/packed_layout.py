"""Where the sequences of a packed (THD) micro-batch sit in its row: the layout a packed micro-batch carries
(:class:`~mcpo_megatron.models.batch.MicroBatch` ``.packing``), made by :mod:`~mcpo_megatron.models.packing` and
cut per context-parallel rank by :mod:`~mcpo_megatron.models.context_parallel`. It imports nothing of the
package, so that the batch and the packer can both name it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedLayout:
    """Where the sequences of one packed micro-batch sit in its row (host tensors).

    Attributes:
        cu_seqlens: [n + 1] int32, cumulative real lengths of the n segments (the last may be the bin's padding).
        cu_seqlens_padded: [n + 1] int32, cumulative lengths after padding each segment to ``seq_multiple``.
        max_seqlen: the longest padded segment (rotary embeddings are computed up to it).
        token_mask: [1, T] bool, True on real (prompt or response) tokens.
    """

    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int
    token_mask: torch.Tensor

    def to(self, device) -> "PackedLayout":
        return PackedLayout(self.cu_seqlens.to(device), self.cu_seqlens_padded.to(device), self.max_seqlen,
                            self.token_mask.to(device))

    def packed_seq_params(self):
        """megatron's ``PackedSeqParams`` (THD) of this layout; int32 lengths on the layout's device.  No
        ``cp_group``: that field switches Transformer Engine's CP group at every call (megatron's dynamic CP);
        the attention keeps the group it was built with."""
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                               cu_seqlens_q_padded=self.cu_seqlens_padded,
                               cu_seqlens_kv_padded=self.cu_seqlens_padded, max_seqlen_q=self.max_seqlen,
                               max_seqlen_kv=self.max_seqlen)


# ---------------------------------------------------------------------------------------------- costs and bins
