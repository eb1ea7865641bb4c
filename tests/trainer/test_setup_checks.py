"""What build_setup refuses before it builds the policy, the engine or the reward pool."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mcpo_megatron.models.tiny import make_tiny_model_with_tokenizer  # noqa: E402

from mcpo_megatron.config import load_config  # noqa: E402
from mcpo_megatron.parallel.distributed import ParallelInfo  # noqa: E402
from mcpo_megatron.trainer import setup  # noqa: E402

INFO = ParallelInfo(rank=0, world_size=1, local_rank=0, tp=1, pp=1, dp=1, tp_rank=0, pp_rank=0, dp_rank=0,
                    is_first_stage=True, is_last_stage=True, tp_group=None, pp_group=None, dp_group=None,
                    device=torch.device("cpu"))


class Reached(Exception):
    """build_setup got past its checks to building the policy."""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model_with_tokenizer(tmp_path_factory.mktemp("tiny") / "model")


def _cfg(model, bench_file, *overrides):
    return load_config(None, [
        f"model.path={model}", "rollout.n=2", "rollout.max_new_tokens=2", "data.train=arith:ops=-,digits=1",
        "data.train_batch_size=2", "data.max_prompt_length=64", "data.max_response_length=4",
        "data.prompt_template=number", "data.num_train_samples=8", "algorithm.mini_batch_size=2",
        "eval.interval=1", f"eval.benchmarks=['amc_2023@{bench_file}']", *overrides])


def _bench(tmp_path, question_chars):
    path = tmp_path / "bench.jsonl"
    rows = [{"id": 0, "question": "What is 1 + 1?", "answer": "2"},
            {"id": 1, "question": "What is " + "1 + " * (question_chars // 4) + "1?", "answer": "9"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _build(cfg, monkeypatch):
    def reached(*_a, **_k):
        raise Reached

    monkeypatch.setattr(setup, "build_policy", reached)
    return setup.build_setup(cfg, INFO)


def test_long_eval_prompt_is_refused_at_setup_with_its_length_and_the_limit(model, tmp_path, monkeypatch):
    cfg = _cfg(model, _bench(tmp_path, 100), "rollout.engine=vllm", "eval.max_new_tokens=3")
    with pytest.raises(ValueError) as e:
        _build(cfg, monkeypatch)
    msg = str(e.value)
    # the engine's context: data.max_prompt_length + the longer of rollout.max_new_tokens (2) and eval's 3
    assert "eval.benchmarks 'amc_2023' problem 1" in msg and "max_model_len=67" in msg, msg
    assert "data.max_prompt_length" in msg and "eval.max_new_tokens=3" in msg
    length = int(msg.split(" has ")[1].split(" prompt tokens")[0])
    assert length > 100 and f"{length} + 3 = {length + 3} > " in msg


def test_eval_prompts_within_the_engine_context_pass(model, tmp_path, monkeypatch):
    with pytest.raises(Reached):
        _build(_cfg(model, _bench(tmp_path, 8), "rollout.engine=vllm"), monkeypatch)
    # the PyTorch engine's limit is the model's max_position_embeddings (256 for the tiny model)
    with pytest.raises(Reached):
        _build(_cfg(model, _bench(tmp_path, 100), "rollout.engine=torch"), monkeypatch)
    with pytest.raises(ValueError, match="max_position_embeddings=256"):
        _build(_cfg(model, _bench(tmp_path, 400), "rollout.engine=torch"), monkeypatch)
