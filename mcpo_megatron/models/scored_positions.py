"""The output layer run on the scored positions only: logits exist for the response tokens, never the sequence.

A loss or log-prob pass needs the vocab-parallel logits of the positions that predict response tokens, a fraction
of the sequence (prompts, padding and packed neighbours are not scored).  ``GPTModel`` would compute logits for
every position, transpose them to [b, S, V/tp] with a copy (megatron-core 0.16.1 ``gpt_model.py:712``, 0.19.2
``:792``), and the backward of a later gather would zero-fill a [b, S, V/tp] gradient.  A forward pre-hook on the
last stage's ``output_layer`` instead selects the scored positions from the final hidden states, so the output
layer's product, its gradient and megatron's transpose all cover [b*T] positions.  The selection is laid out as
[b*T, 1, h], which megatron's transpose turns into [1, b*T, V/tp] without a copy (a size-1 dimension); the caller
views it as [b, T, V/tp].

Under sequence parallelism the hidden states reach the output layer split over TP ([S/tp, b, h]) and the layer
would all-gather them itself.  The hook gathers them first (a selection needs the whole row) and runs the layer
without its sequence-parallel all-gather for that one call, as megatron-core's own inference path does
(``gpt_model.py:664-686`` in 0.16.1).  The gradient then stays right: the layer's ``allreduce_dgrad`` is fixed
when it is built (``tensor_parallel/layers.py:920``, False under sequence parallelism), so with the flag off the
layer's input goes through ``copy_to_tensor_model_parallel_region`` (``:994-1001``), whose backward all-reduces
the input gradient over TP; the gather is therefore told that its output gradient is already whole
(``tensor_parallel_output_grad=False``: its backward only keeps this rank's slice), and the two together are the
reduce-scatter the layer's own backward would have done.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


def select_scored_positions(hidden: torch.Tensor, resp_index: torch.Tensor) -> torch.Tensor:
    """[b*T, 1, h]: the hidden states ([S, B, h]) at ``resp_index`` ([b, T] positions into each row), row-major
    over (sequence, token).

    B is b for a padded micro-batch (sequence i is row i) and 1 for a packed one (every sequence indexes into
    the one row)."""
    s, rows, h = hidden.shape
    b = resp_index.shape[0]
    if rows not in (b, 1):
        raise ValueError(f"hidden states of {rows} rows for {b} sequences: expected {b} rows, or 1 packed row")
    flat = resp_index if rows == 1 else resp_index * rows + torch.arange(b, device=resp_index.device).unsqueeze(1)
    return hidden.reshape(s * rows, h).index_select(0, flat.reshape(-1)).unsqueeze(1)


class ScoredOutputLayer:
    """Runs ``chunk.output_layer`` (a ``ColumnParallelLinear``) on the scored positions of the micro-batch given
    to :meth:`scoring`; outside it the layer is untouched (full logits, for callers that want them)."""

    def __init__(self, chunk: torch.nn.Module, tp_group):
        self.layer = chunk.output_layer
        self.tp_group = tp_group
        self.sequence_parallel = bool(self.layer.sequence_parallel)
        self.resp_index: torch.Tensor | None = None
        self.layer.register_forward_pre_hook(self._select, with_kwargs=True)
        self.layer.register_forward_hook(self._restore)

    @contextmanager
    def scoring(self, resp_index: torch.Tensor):
        """Within it, the chunk's next forward computes logits at ``resp_index`` only ([1, b*T, V/tp] out)."""
        self.resp_index = resp_index
        try:
            yield
        finally:
            self.resp_index = None
            self.layer.sequence_parallel = self.sequence_parallel

    def _select(self, layer, args, kwargs):
        if self.resp_index is None:
            return None
        hidden, index = args[0], self.resp_index
        self.resp_index = None  # one output-layer call per forward
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False,
                                                          group=self.tp_group)
            layer.sequence_parallel = False
        return (select_scored_positions(hidden, index), *args[1:]), kwargs

    def _restore(self, layer, args, output):
        layer.sequence_parallel = self.sequence_parallel
