"""Partial rollouts (docs/algorithms.md §13): generation in segments that can stop at any step and continue later
(``segments.py``), and the pool of unfinished records carried from step to step (``pool.py``).

It imports ``rollout/engines/`` (the interface, records and sessions), never an engine's own sub-package, nor
placement or separate placement.
"""
