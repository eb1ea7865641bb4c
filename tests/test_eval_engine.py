"""`mcpo eval`'s vLLM engine: its tensor-parallel size from the model and the visible GPUs, and the engine it
builds (alone on its GPUs: the dedicated share, no sleep mode, vLLM's own executor), with CUDA mocked and vLLM's
engine faked. The real engine runs in tests/trainer/test_vllm_e2e.py."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from mcpo_megatron import cli, planner
from mcpo_megatron.config import KNOWN_SHAPES, ModelShape

GIB = 1024 ** 3
LONGEST = 2048 + 20480  # the recipes' prompt + response: vLLM's max_model_len


def known(name: str) -> ModelShape:
    return ModelShape(**KNOWN_SHAPES[name], source=name)


def test_smallest_engine_tp_by_hand():
    """Qwen3-32B (32.8B parameters, bf16: 61.0 GiB; 64 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes = 256 KiB
    per token) on 80 GiB GPUs at 0.9 = 72 GiB, less vLLM's 2 GiB allowance:
    TP=1: KV 72 - 61.0 - 2 = 9.0 GiB = 36.8k tokens = 1.6 sequences of 22,528 < 8;
    TP=2: KV 72 - 30.5 - 2 = 39.5 GiB at 128 KiB per token and GPU = 323k tokens = 14.4 sequences >= 8."""
    shape = known("qwen/qwen3-32b")
    weights = planner.param_counts(shape, 1, 1)["total"] * 2
    assert weights / GIB == pytest.approx(61.0, abs=0.05)
    tp, eng = planner.smallest_engine_tp(shape, gpus=8, gpu_mem_bytes=80 * GIB, utilization=0.9, max_len=LONGEST)
    assert tp == 2
    assert eng["kv_cache"] == pytest.approx(72 * GIB - weights / 2 - 2 * GIB)
    assert eng["kv_bytes_per_token"] == 128 * 1024
    assert eng["full_length_sequences"] == pytest.approx((72 * GIB - weights / 2 - 2 * GIB) / (128 * 1024) / LONGEST)
    # Qwen3-8B (15.3 GiB) leaves 54.7 GiB of KV at TP=1: 144 KiB per token -> 17.7 sequences
    assert planner.smallest_engine_tp(known("qwen/qwen3-8b"), gpus=8, gpu_mem_bytes=80 * GIB, utilization=0.9,
                                      max_len=LONGEST)[0] == 1
    # 40 heads: vLLM cannot split Qwen3-14B over 3 GPUs; on 24 GiB cards TP=1 (21.6 - 27.5 GiB) and 2 do not fit
    # 8 sequences, so the next size it can use is 4
    tp14, _ = planner.smallest_engine_tp(known("qwen/qwen3-14b"), gpus=8, gpu_mem_bytes=24 * GIB, utilization=0.9,
                                         max_len=LONGEST)
    assert not planner.vllm_splits(known("qwen/qwen3-14b"), 3) and tp14 == 4


def test_no_size_fits_the_visible_gpus():
    with pytest.raises(ValueError) as e:
        planner.smallest_engine_tp(known("qwen/qwen3-32b"), gpus=1, gpu_mem_bytes=80 * GIB, utilization=0.9,
                                   max_len=LONGEST)
    assert str(e.value).startswith(
        "no tensor-parallel size up to the 1 GPU(s) of 80 GiB gives the engine room for 8 sequences of 22528 tokens "
        "at 0.9 of each GPU: at TP=1 the weights take 61.0 GiB per GPU and the KV cache holds 1.6; use more GPUs")


def model_like(tmp_path: Path, name: str) -> Path:
    """A Hugging Face directory with ``name``'s config.json (no weights: the engine is faked) and a tokenizer."""
    from mcpo_megatron.models.tiny import save_char_tokenizer

    s = KNOWN_SHAPES[name]
    out = tmp_path / name.split("/")[-1]
    out.mkdir()
    save_char_tokenizer(out)
    (out / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": s["num_layers"],
        "hidden_size": s["hidden_size"], "num_attention_heads": s["num_attention_heads"],
        "num_key_value_heads": s["num_key_value_heads"], "intermediate_size": s["ffn_hidden_size"],
        "vocab_size": s["vocab_size"], "head_dim": s["head_dim"], "max_position_embeddings": 40960,
        "tie_word_embeddings": s["tie_word_embeddings"], "eos_token_id": 2, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}))
    return out


@pytest.fixture
def eval_without_benchmarks(monkeypatch):
    """`mcpo eval` up to its engine: the benchmarks, the reward pool and the report are left out."""
    from mcpo_megatron.commands import eval as eval_command
    from mcpo_megatron.evaluation import run as evaluation
    from mcpo_megatron.trainer import components

    engines = []

    def keep_engine(rollouts, *args, **kwargs):
        engines.append(rollouts.engine)
        return {}

    monkeypatch.setattr(evaluation, "evaluate_benchmarks", keep_engine)
    monkeypatch.setattr(components, "build_scorer", lambda cfg: contextlib.nullcontext())
    monkeypatch.setattr(eval_command, "_report", lambda table, out: None)
    return engines


def mcpo_eval(model: Path, *extra: str) -> int:
    """``mcpo eval`` with the recipes' lengths; ``extra``: options, then ``key=value`` overrides."""
    options = [a for a in extra if "=" not in a]
    overrides = [a for a in extra if "=" in a]
    return cli.main(["eval", "--model", str(model), "--benchmarks", "arith", "--engine", "vllm", *options,
                     "data.max_prompt_length=2048", "rollout.max_new_tokens=20480", *overrides])


def test_eval_engine_spans_the_gpus_the_model_needs(tmp_path, monkeypatch, eval_without_benchmarks, capsys):
    """Qwen3-32B on a node of 8 x 80 GiB: TP=2 at 0.9 of each GPU, no sleep mode, vLLM's own executor (a worker
    per GPU), no weight-transfer backend; the checkpoint's colocated share (0.5) and sleep mode do not apply."""
    import os

    from fake_vllm import fake_cuda_vllm

    built = fake_cuda_vllm(monkeypatch, gpus=8, gpu_memory_bytes=80 * GIB)
    model = model_like(tmp_path, "qwen/qwen3-32b")
    assert mcpo_eval(model, "rollout.gpu_memory_utilization=0.5", "rollout.enable_sleep_mode=true") == 0
    (kw,) = built
    assert kw["tensor_parallel_size"] == 2 and kw["gpu_memory_utilization"] == 0.9
    assert kw["enable_sleep_mode"] is False and kw["max_model_len"] == LONGEST
    assert "distributed_executor_backend" not in kw and "weight_transfer_config" not in kw
    assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ  # no external launcher to feed
    (engine,) = eval_without_benchmarks
    assert engine.standalone and not engine.sleep_enabled
    assert "vLLM engine: TP=2 on 2 of the 8 visible GPU(s), 0.9 of each" in capsys.readouterr().out

    assert mcpo_eval(model, "--tensor-parallel-size", "4", "rollout.dedicated_gpu_memory_utilization=0.8") == 0
    assert (built[1]["tensor_parallel_size"], built[1]["gpu_memory_utilization"]) == (4, 0.8)


@pytest.mark.parametrize("extra,message", [
    (["--tensor-parallel-size", "3"], "--tensor-parallel-size 3: vLLM splits"),
    (["--tensor-parallel-size", "16"], "--tensor-parallel-size 16: this process sees 8 GPU(s)"),
    (["eval.max_new_tokens=300000"],
     "no tensor-parallel size up to the 8 GPU(s) of 80 GiB gives the engine room for 8 sequences"),
])
def test_eval_engine_that_cannot_run_is_refused(tmp_path, monkeypatch, eval_without_benchmarks, capsys, extra,
                                               message):
    from fake_vllm import fake_cuda_vllm

    built = fake_cuda_vllm(monkeypatch, gpus=8, gpu_memory_bytes=80 * GIB)
    assert mcpo_eval(model_like(tmp_path, "qwen/qwen3-32b"), *extra) == 1
    assert message in capsys.readouterr().err and built == []
