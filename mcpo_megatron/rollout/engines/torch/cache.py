"""Row selection in a transformers cache, for the PyTorch engine's batches that drop their finished rows."""

from __future__ import annotations

import torch


def keep_cache_rows(cache, rows: torch.Tensor) -> None:
    """Keep only ``rows`` (a long tensor on the cache's device) of every layer of ``cache``, in place.

    Key/value layers select rows with ``batch_select_indices``. A hybrid model's linear-attention layers (Gated
    DeltaNet: a convolution state and a recurrent state per sequence) have no such method in transformers 5.19
    (``cache_utils.LinearAttentionLayer``; ``DynamicCache.batch_select_indices``, cache_utils.py:1681-1684, calls
    it on every layer and fails there), so their states are selected with ``reorder_cache``, the same
    ``index_select`` on the batch dimension (cache_utils.py:1004-1011); a layer with both kinds gets both."""
    from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            layer.reorder_cache(rows)
            if isinstance(layer, DynamicLayer):
                DynamicLayer.batch_select_indices(layer, rows)
        else:
            layer.batch_select_indices(rows)
