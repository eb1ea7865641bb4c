"""The recipes in configs/: each loads and validates for the world size it declares, and the paper's recipes
hold the paper's values."""

import re

import pytest

from mcpo_megatron import config as C
from mcpo_megatron.config import hinge_is_inert, load_config, validate

from config_cases import CONFIG_DIR, config_files


def test_configs_directory_has_the_paper_recipes():
    names = {p.name for p in config_files()}
    assert {"qwen3_8b_mcpo.yaml", "qwen3_8b_dapo.yaml", "qwen3_8b_dapo_ds.yaml",
            "qwen3_14b_mcpo.yaml", "qwen3_14b_dapo.yaml"} <= names


@pytest.mark.parametrize("path", config_files(), ids=lambda p: p.name)
def test_every_config_loads_and_validates_for_its_world_size(path):
    """Convention: a runnable config declares `# world_size: N`; files named `_*.yaml` are bases."""
    cfg = load_config(str(path))
    if path.name.startswith("_"):
        return
    world = C.declared_world_size(str(path))
    assert world is not None, f"{path.name}: add a '# world_size: N' comment line (the intended number of ranks)"
    validate(cfg, world)
    assert re.search(r"^#.*(node|process|CPU|GPU)", path.read_text(), re.MULTILINE | re.IGNORECASE), \
        f"{path.name}: say in a comment which cluster shape the recipe is for"


def test_paper_recipe_values():
    for name in ("qwen3_8b_mcpo", "qwen3_14b_mcpo"):
        cfg = load_config(str(CONFIG_DIR / f"{name}.yaml"))
        a = cfg.algorithm
        assert (cfg.data.train_batch_size, cfg.rollout.n, a.mini_batch_size, cfg.optimizer.lr) == (128, 16, 64, 1e-6)
        assert (a.clip_ratio_low, a.clip_ratio_high, a.loss_agg_mode) == (0.2, 0.28, "seq-mean-token-mean")
        assert (cfg.data.max_response_length, cfg.reward.overlong_buffer.len) == (20480, 4096)
        assert (a.mcpo.reweight, a.mcpo.hinge_kl.enable, a.mcpo.hinge_kl.coef, a.mcpo.hinge_kl.delta) == (True, True, 1.0, 0.01)
        assert (cfg.data.train, cfg.data.prompt_template, cfg.rollout.engine, cfg.model.dtype) == \
            ("dapo_math_17k", "dapo", "vllm", "bf16")
        assert (list(cfg.eval.benchmarks), cfg.eval.k, cfg.eval.temperature) == (["aime_2024", "aime_2025", "amc_2023"], 8, 0.7)
        assert a.filter_groups.enable is False
        assert not hinge_is_inert(cfg)
        # the training state leaves the GPU while vLLM generates, which takes what that frees
        assert cfg.trainer.offload.enable is None and C.offload_enabled(cfg, cuda=True)
        assert not C.offload_enabled(cfg, cuda=False) and cfg.rollout.gpu_memory_utilization is None
    assert load_config(str(CONFIG_DIR / "qwen3_8b_mcpo.yaml")).model.path == "Qwen/Qwen3-8B"
    assert load_config(str(CONFIG_DIR / "qwen3_14b_mcpo.yaml")).model.path == "Qwen/Qwen3-14B"
    assert C.declared_world_size(str(CONFIG_DIR / "qwen3_8b_mcpo.yaml")) == 8
    assert C.declared_world_size(str(CONFIG_DIR / "qwen3_14b_mcpo.yaml")) == 16
    for name in ("qwen3_8b_dapo", "qwen3_14b_dapo", "qwen3_8b_dapo_ds"):
        cfg = load_config(str(CONFIG_DIR / f"{name}.yaml"))
        assert (cfg.algorithm.mcpo.reweight, cfg.algorithm.mcpo.hinge_kl.enable) == (False, False)
        assert cfg.algorithm.filter_groups.enable is (name == "qwen3_8b_dapo_ds")
        assert (cfg.data.train_batch_size, cfg.algorithm.clip_ratio_high) == (128, 0.28)


def test_recipe_ablation_overrides_validate():
    path = str(CONFIG_DIR / "qwen3_8b_mcpo.yaml")
    for override in ("algorithm.mcpo.reweight=false", "algorithm.mcpo.hinge_kl.enable=false"):
        validate(load_config(path, [override]), 8)
    for path in (CONFIG_DIR / "qwen3_14b_mcpo.yaml", CONFIG_DIR / "qwen3_14b_dapo.yaml"):
        validate(load_config(str(path), ["parallelism.pipeline_model_parallel_size=2"]), 16)


@pytest.mark.parametrize("path", [p for p in config_files() if not p.name.startswith("_")], ids=lambda p: p.name)
def test_every_recipe_takes_partial_rollouts(path):
    """rollout.partial (with its staleness and the token mask) validates on every recipe's layout: none of the
    layouts, engines, algorithms or the Python tool's episodes restricts it."""
    partial = ["rollout.partial.enable=true", "trainer.max_staleness=1", "algorithm.token_mask.enable=true"]
    validate(load_config(str(path), partial), C.declared_world_size(str(path)))
