"""Separate placement (``rollout.placement=separate``): engines on ranks of their own. The trainer side
(``remote.py``), the engine-rank server (``server.py``), the weight publisher that stages the trainer's weights
for the engines (``publisher.py``), the messages between the two sides (``messages.py``), the plan of a weight
update across them (``plan.py``) and the bounded waits and heartbeats (``liveness.py``).

The highest sub-package of rollout/: it may import ``placement.py``, ``partial/``, ``engines/`` (the interface
only) and ``weights/``; nothing in rollout/ imports it.
"""
