"""Rules on single values across sections (finite floats, choices, reward, optimizer, checkpoint), each naming
its key and refusing, before anything is built, a value the run would otherwise refuse (or misuse) only once
the model and the engine exist; every violation is reported at once."""

import pytest

from mcpo_megatron import config as C
from mcpo_megatron.config import ConfigError, load_config, validate

from config_cases import TINY, ok, problems


def test_reward_timeout():
    assert problems(["reward.timeout_s=0"]) == [
        "reward.timeout_s=0.0: must be > 0 (wall-clock kill of a verifier call); use e.g. 10"]


# Each of these passed validation before and failed once the model and the engine were built.

def _float_keys(node=C.Config, prefix=""):
    """Every float leaf of the schema (float or Optional[float]), as a dotted key."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(node)
    for f in dataclasses.fields(node):
        key, tp = f"{prefix}.{f.name}" if prefix else f.name, hints[f.name]
        sub = next((t for t in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(t)), None)
        if sub is not None:
            yield from _float_keys(sub, key)
        elif float in (tp, *typing.get_args(tp)):
            yield key


def test_every_float_key_refuses_inf_and_nan():
    keys = list(_float_keys())
    assert "reward.timeout_s" in keys and "rollout.temperature" in keys and len(keys) > 20
    for value in ("inf", "-inf", "nan"):   # every violation is reported at once: one config per value
        found = problems([f"{key}={value}" for key in keys])
        for key in keys:
            assert f"{key}={float(value)}: must be a finite number; set {key} to a finite value" in found, key


def test_reward_timeout_and_temperature_inf_name_the_key():
    assert problems(["reward.timeout_s=inf"]) == [
        "reward.timeout_s=inf: must be a finite number; set reward.timeout_s to a finite value"]
    assert problems(["rollout.temperature=inf"]) == [
        "rollout.temperature=inf: must be a finite number; set rollout.temperature to a finite value"]


def test_keep_last_zero_is_refused():
    assert problems(["checkpoint.keep_last=0"]) == ["checkpoint.keep_last=0: must be >= 1; set a positive value"]
    ok(["checkpoint.keep_last=1"])


@pytest.mark.parametrize("memory_mb", [-1, 0, 1, 15, 16, 63, 64, 2048])
def test_reward_memory_rule_is_the_scorers(monkeypatch, memory_mb):
    """The schema accepts reward.memory_mb exactly when the scorer accepts its memory_mb (it stops at its own
    check or at starting its first worker)."""
    from mcpo_megatron.rewards import scorer

    class Started(Exception):
        pass

    def no_worker(*args):
        raise Started

    monkeypatch.setattr(scorer, "_Worker", no_worker)
    try:
        scorer.MathVerifyScorer(1, 10.0, memory_mb)
    except Started:
        scorer_accepts = True
    except ValueError as e:
        assert "memory_mb" in str(e)
        scorer_accepts = False
    cfg = load_config(None, TINY + [f"reward.memory_mb={memory_mb}"])
    try:
        validate(cfg, 1)
        schema_accepts = True
    except ConfigError as e:
        assert [p.split(":")[0] for p in e.problems] == [f"reward.memory_mb={memory_mb}"]
        schema_accepts = False
    assert schema_accepts == scorer_accepts
    assert schema_accepts == (memory_mb == 0 or memory_mb >= 64)


def test_lr_warmup_must_end_before_the_decay():
    # 128 prompts per step / mini-batches of 64 = 2 optimizer steps per step: 200 in 100 steps
    assert problems(["optimizer.lr_schedule=cosine", "optimizer.lr_warmup_steps=200", "trainer.total_steps=100"]) == [
        "optimizer.lr_warmup_steps=200: must be < the run's 200 optimizer steps (trainer.total_steps=100 x 2 per "
        "step) for optimizer.lr_schedule=cosine to decay; lower optimizer.lr_warmup_steps, raise "
        "trainer.total_steps or use optimizer.lr_schedule=constant"]
    ok(["optimizer.lr_schedule=linear", "optimizer.lr_warmup_steps=199", "trainer.total_steps=100"])
    ok(["optimizer.lr_schedule=constant", "optimizer.lr_warmup_steps=500", "trainer.total_steps=100"])


@pytest.mark.parametrize("override, message", [
    ("optimizer.lr=0", "optimizer.lr=0.0: must be > 0; use e.g. 1e-6"),
    ("optimizer.min_lr=1", "optimizer.min_lr=1.0: must satisfy 0 <= min_lr <= lr=1e-06; use 0"),
    ("optimizer.adam_beta2=1", "optimizer.adam_beta2=1.0: must satisfy 0 <= beta < 1; use 0.9 / 0.999"),
    ("optimizer.weight_decay=-0.1", "optimizer.weight_decay=-0.1: must be >= 0; use 0 to disable"),
    ("optimizer.grad_clip=-1", "optimizer.grad_clip=-1.0: must be >= 0; use 0 to disable"),
    ("optimizer.adam_eps=0", "optimizer.adam_eps=0.0: must be > 0; use 1e-8"),
    ("optimizer.lr_schedule=step",
     "optimizer.lr_schedule=step: must be one of constant | cosine | linear; set optimizer.lr_schedule to one of those"),
    ("optimizer.lr_warmup_steps=-1", "optimizer.lr_warmup_steps=-1: must be >= 0; set 0 or a positive value"),
])
def test_optimizer_rules_name_the_key(override, message):
    """The optimizer's rules are the schema's alone (models/optim.py takes a validated config under megatron's
    names and does not check them again)."""
    assert problems([override]) == [message]


def test_choice_keys():
    assert problems(["rollout.engine=sglang"]) == [
        "rollout.engine=sglang: must be one of torch | vllm; set rollout.engine to one of those"]
    assert problems(["algorithm.loss_agg_mode=sum"]) == [
        "algorithm.loss_agg_mode=sum: must be one of token-mean | seq-mean-token-mean | seq-mean-token-sum | "
        "seq-mean-token-sum-norm; set algorithm.loss_agg_mode to one of those"]


def test_every_violation_reported_together():
    p = problems(["rollout.n=1", "algorithm.clip_ratio_low=0", "algorithm.mcpo.hinge_kl.delta=-1",
                  "rollout.temperature=0", "reward.timeout_s=-1", "algorithm.adv_estimator=drgrpo",
                  "data.train_batch_size=100", "parallelism.pipeline_model_parallel_size=4"], 6)
    keys = [line.split("=", 1)[0] for line in p]
    assert sorted(keys) == sorted([
        "rollout.n", "algorithm.clip_ratio_low", "algorithm.mcpo.hinge_kl.delta", "rollout.temperature",
        "reward.timeout_s", "algorithm.adv_estimator", "data.train_batch_size", "world_size",
        "parallelism.pipeline_model_parallel_size"])
    cfg = load_config(None, TINY + ["rollout.n=1", "rollout.temperature=0"])
    with pytest.raises(ConfigError) as ei:
        validate(cfg, 1)
    msg = str(ei.value)
    assert msg.startswith("invalid config (2 problems):\n  - ")
    assert "rollout.n=1: must be >= 2" in msg and "rollout.temperature=0.0: must be > 0" in msg
