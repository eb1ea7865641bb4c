"""Runs the trainer like ``mcpo train`` and, on rank 0, saves every ``compute_logprobs`` call
of the policy and of the reference policy, in call order, to ``$MCPO_TEST_LOGPROBS`` (a list of
``(kind, [per-sequence log-probs])``, kind "policy" or "reference")."""

import os
import sys

import torch

from mcpo_megatron.models.passes import PipelinePasses
from mcpo_megatron.models.reference import ReferencePolicy

_compute = PipelinePasses.compute_logprobs
_calls = []


def _recorded(self, batch, **kwargs):
    logps, ents = _compute(self, batch, **kwargs)
    if os.environ["RANK"] == "0":
        _calls.append(("reference" if isinstance(self, ReferencePolicy) else "policy", [x.clone() for x in logps]))
        torch.save(_calls, os.environ["MCPO_TEST_LOGPROBS"])
    return logps, ents


PipelinePasses.compute_logprobs = _recorded  # the policy's and the reference's

if __name__ == "__main__":
    from mcpo_megatron.cli import main

    sys.exit(main(["train", *sys.argv[1:]]))
