"""Every cluster recipe in configs/ has a CPU rehearsal twin in configs/rehearsal/ that keeps what breaks at
scale: the parallel layout scaled onto 4 ranks (each of TP, PP, VPP, EP, CP above 1 stays above 1, at most 2;
data x context parallelism of at least 2), the dtype and every option. Only the keys listed in SCALED may differ, each for a
stated reason; a new key of the schema is compared like every other."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from mcpo_megatron.config import load_config, validate

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TWIN_RANKS = 4  # tests/launch/test_rehearsal_sbatch.py: 2 nodes x 2 tasks
RECIPES = sorted(p.stem for p in CONFIGS.glob("*.yaml") if not p.name.startswith(("_", "cpu_")))

LAYOUT = ("parallelism.tensor_model_parallel_size", "parallelism.pipeline_model_parallel_size",
          "parallelism.virtual_pipeline_model_parallel_size", "parallelism.expert_model_parallel_size",
          "parallelism.context_parallel_size", "rollout.tensor_parallel_size")
SCALED = {
    # a tiny model made by code: no weights to download on a CPU machine
    "model.path": "tiny model", "model.tokenizer": "tiny model",
    # the recipes' vLLM CUDA build needs GPUs; sizes of a few short steps
    "rollout.engine": "CPU engine", "rollout.n": "size", "rollout.max_new_tokens": "size",
    "rollout.generation_batch_size": "size", "rollout.max_num_seqs": "size", "reshard.bucket_mb": "size",
    "algorithm.mini_batch_size": "size",
    # offline prompts the tiny model's tokenizer can write answers to
    "data.train": "offline data", "data.train_batch_size": "size", "data.max_prompt_length": "size",
    "data.max_response_length": "size", "data.prompt_template": "offline data", "data.num_train_samples": "size",
    "reward.answer_format": "offline data",
    # the scripted tool model reads the bare question (no chat template); the sandbox sized for 2 CPUs a node
    "data.apply_chat_template": "offline data", "tools.workers": "size", "tools.max_output_tokens": "size",
    "reward.num_workers": "size", "reward.overlong_buffer.len": "size",
    "trainer.total_steps": "size", "trainer.max_tokens_per_microbatch": "size",
    "trainer.logprob_chunk_size": "size", "trainer.output_dir": "run directory",
    "checkpoint.interval": "size (periodic in both: checked below)", "checkpoint.keep_last": "size",
    # the rehearsal evaluates with slurm/eval.sbatch after training
    "eval.interval": "evaluated by eval.sbatch", "eval.max_new_tokens": "size",
}


def flat(cfg) -> dict:
    out = {}

    def walk(prefix, node):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = node

    walk("", OmegaConf.to_container(cfg, resolve=True))
    return out


def test_every_recipe_has_a_twin():
    assert RECIPES, "no recipes found in configs/"
    missing = [r for r in RECIPES if not (CONFIGS / "rehearsal" / f"{r}.yaml").is_file()]
    assert not missing, f"recipes without a CPU rehearsal twin in configs/rehearsal/: {missing}"
    extra = sorted(p.stem for p in (CONFIGS / "rehearsal").glob("[!_]*.yaml") if p.stem not in RECIPES)
    assert not extra, f"twins of no recipe: {extra}"


@pytest.mark.parametrize("recipe", RECIPES)
def test_twin_keeps_the_recipe_layout_dtype_and_options(recipe):
    want = flat(load_config(str(CONFIGS / f"{recipe}.yaml")))
    twin_cfg = load_config(str(CONFIGS / "rehearsal" / f"{recipe}.yaml"))
    got = flat(twin_cfg)
    assert set(got) == set(want)
    for key in LAYOUT:
        r, t = want[key] or 1, got[key] or 1
        assert (r > 1) == (t > 1) and t <= min(r, 2), f"{key}: recipe {r}, twin {t}"
    assert want["model.dtype"] == got["model.dtype"] == "bf16"
    assert want["checkpoint.interval"] > 0 and 0 < got["checkpoint.interval"] < got["trainer.total_steps"]
    differ = {k: (want[k], got[k]) for k in want if k not in SCALED and k not in LAYOUT and want[k] != got[k]}
    assert not differ, f"keys the twin changes without a reason in SCALED: {differ}"
    # on the rehearsal's ranks: valid, with data (or context) parallelism: ranks split their shares, or each
    # sequence, on their own
    validate(twin_cfg, world_size=TWIN_RANKS)
    tp, pp = got["parallelism.tensor_model_parallel_size"], got["parallelism.pipeline_model_parallel_size"]
    assert TWIN_RANKS // (tp * pp) >= 2
