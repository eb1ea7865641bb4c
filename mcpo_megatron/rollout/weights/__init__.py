"""The weight update, trainer to engines: both ends' layouts (``layouts.py``), what an engine exposes to be written
in place (``target.py``), the reshard plan compiled once per layout (``plan.py``), the buffers and collectives
that carry it (``transfer.py``), and the trainer side that runs it or, for an engine without a target, streams
Hugging Face buckets (``resharder.py``).

The lowest sub-package of rollout/: it imports only the package's building blocks below rollout/ (models,
parallel); engines name their weights in its terms, so it never imports an engine.
"""
