"""Runs the trainer like ``mcpo train``, but step ``$MCPO_TEST_FAULT_STEP`` raises after its
rollouts, rewards and old log-probs, before its updates; every close of the logger, the reward pool and the
engine is appended to ``$MCPO_TEST_CLOSE_LOG.<rank>`` (one name per line), so the test sees what was closed, in
which order."""

import os
import sys

from mcpo_megatron.rewards.scorer import MathVerifyScorer
from mcpo_megatron.rollout.engines.torch.engine import TorchRolloutEngine
from mcpo_megatron.trainer import loop
from mcpo_megatron.trainer.metrics import MetricsLogger


def _record(cls, name):
    close = cls.close
    closed = set()  # the first close of each object (later ones, e.g. from __del__, are no-ops)

    def recorded(self, *args, **kwargs):
        if id(self) not in closed:
            closed.add(id(self))
            with open(f"{os.environ['MCPO_TEST_CLOSE_LOG']}.{os.environ['RANK']}", "a") as f:
                f.write(name + "\n")
        return close(self, *args, **kwargs)

    cls.close = recorded


for cls, name in ((MetricsLogger, "logger"), (MathVerifyScorer, "reward_pool"), (TorchRolloutEngine, "engine")):
    _record(cls, name)

_update_policy = loop.update_policy
_steps = []


def _fault_at_step(*args, **kwargs):
    _steps.append(None)
    if len(_steps) == int(os.environ["MCPO_TEST_FAULT_STEP"]):
        raise RuntimeError(f"injected fault in step {len(_steps)}")
    return _update_policy(*args, **kwargs)


loop.update_policy = _fault_at_step

if __name__ == "__main__":
    from mcpo_megatron.cli import main

    sys.exit(main(["train", *sys.argv[1:]]))
