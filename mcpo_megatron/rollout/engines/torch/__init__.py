"""The PyTorch reference engine (``engine.py``: a transformers model, sampled exactly as the interface defines)
and its generation session (``session.py``). It imports ``rollout/engines/`` and ``rollout/weights/``, not vLLM's
sub-package."""
