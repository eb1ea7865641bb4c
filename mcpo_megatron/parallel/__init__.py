"""Everything that knows about TP/PP/DP groups.

- ``cpu_shim``: makes megatron-core's ``torch.cuda`` calls work on CPU/gloo.
- ``distributed``: ``init_distributed`` -> ``ParallelInfo``, and small collectives.
- ``gpu_binding``: which CUDA device a rank uses (local rank, tasks per node, the devices it sees).
- ``logprobs``: chunked vocab-parallel log-probs and entropy (custom backward).
- ``pinned``: page-locked host memory of exactly the size asked for (CUDA host registration).

Import the submodules directly; this package imports nothing heavy.
"""
