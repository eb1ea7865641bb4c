"""The vLLM engine (``engine.py``) with its session (``session.py``), the arguments it builds vLLM with
(``args.py``), the requests it sends and the outputs it converts (``requests.py``), the weight target over vLLM's
model (``target.py``) and the weight transfer backend it registers with vLLM (``transfer.py``). It imports
``rollout/engines/`` and ``rollout/weights/``, not the PyTorch engine's sub-package."""
