"""Generation for the trainer: the engines, how the trainer's weights reach them, partial rollouts, and where the
engines run.

Sub-packages, each importing only those listed before it (``tests/test_layers.py`` checks it; the picture is in
docs/decisions.md, "rollout/ by concern"): ``weights/`` (the weight update: layouts, the compiled plan, its
transfer, the Hugging Face stream), ``engines/`` (the engine interface, records and sessions; ``torch/`` and
``vllm/``, each engine with its session), ``episodes.py`` (multi-turn episodes with the Python tool, around
any engine), ``partial/`` (segments and the pool of partial rollouts),
``placement.py`` (the trainer's one interface to generation, colocated engines behind it) and ``separate/``
(engines on ranks of their own: the trainer side, the engine-rank server, the weight publisher, messages,
liveness).
"""
