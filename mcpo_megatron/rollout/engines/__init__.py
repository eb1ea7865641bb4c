"""The generation engines: the interface every engine implements and its sampling types (``interface.py``), the
records and sessions of generation in segments (``records.py``), the engine / trainer numerics contract
(``contract.py``), and one sub-package per engine, each with its session: ``torch/`` (the PyTorch reference
engine) and ``vllm/`` (vLLM: its arguments, requests, weight target and weight transfer backend).

It may import ``rollout/weights/`` (the layout an engine's weight target declares) and the package's building
blocks below rollout/ (models, algorithms, parallel, config); ``torch/`` and ``vllm/`` never import each other.
"""
