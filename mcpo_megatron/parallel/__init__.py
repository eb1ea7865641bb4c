"""Everything that knows about TP/PP/DP groups.

- ``cpu_shim``: makes megatron-core's ``torch.cuda`` calls work on CPU/gloo.
- ``distributed``: ``init_distributed`` -> ``ParallelInfo``, and small collectives.
- ``logprobs``: chunked vocab-parallel log-probs and entropy (custom backward).

Import the submodules directly; this package imports nothing heavy.
"""
