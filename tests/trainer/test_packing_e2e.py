"""End to end on CPU/gloo (tiny model, 2 processes): the trainer with packed micro-batches, at DP=2 (shares
balanced by Karmarkar-Karp) and at CP=2 (each sequence split over both ranks), against the padded DP=2 run. Two
steps each, several micro-batches per rank: the step records (rewards, losses, gradient norms, clip and hinge
fractions) agree within fp32 rounding."""

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_resume_e2e import REPO, _cmd, _env, _overrides  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mcpo_megatron.models.tiny import make_tiny_model_with_tokenizer  # noqa: E402
from mcpo_megatron.trainer.metrics import read_jsonl  # noqa: E402

pytestmark = pytest.mark.multiproc
# The tiny random model answers nothing right (every advantage is 0): an entropy bonus gives every step a loss and
# a gradient. Replies of up to 4 tokens and a 160-token budget: two or three sequences per micro-batch (bin).
DP2 = ["parallelism.tensor_model_parallel_size=1", "trainer.max_tokens_per_microbatch=160",
       "algorithm.entropy_coeff=0.01", "rollout.max_new_tokens=4", "data.max_response_length=4"]
RUNS = {"padded": DP2, "packed": DP2 + ["trainer.sequence_packing=true"],
        "cp2": DP2 + ["trainer.sequence_packing=true", "parallelism.context_parallel_size=2"]}
COMPARED = ("actor/loss", "actor/pg_loss", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl",
            "actor/entropy", "reward/mean", "adv/mean", "response/length_mean", "hkl/active_frac")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("packing")
    model = make_tiny_model_with_tokenizer(root / "model")
    out = {}
    for name, extra in RUNS.items():
        with open(root / f"{name}.log", "w") as f:
            proc = subprocess.run(_cmd(_overrides(model, root / name, steps=2) + extra), cwd=REPO, env=_env(),
                                  stdout=f, stderr=subprocess.STDOUT, timeout=600)
        assert proc.returncode == 0, (root / f"{name}.log").read_text()[-6000:]
        out[name] = read_jsonl(root / name / "metrics.jsonl")
    return out


@pytest.mark.parametrize("name", ["packed", "cp2"])
def test_packed_training_steps_like_the_padded_run(runs, name):
    ref, got = runs["padded"], runs[name]
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [1, 2]
    for a, b in zip(got, ref):
        for key in COMPARED:
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), (name, a["step"], key)
    assert all(abs(r["actor/loss"]) > 1e-4 and r["actor/grad_norm"] > 1e-4 for r in ref)  # not a trivial step
    assert got[0]["actor/microbatches"] > (1 if name == "cp2" else 2)  # several bins per data-parallel rank
