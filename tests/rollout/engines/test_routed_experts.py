"""The PyTorch engine's routing output (``return_routed_experts``, what model.moe_routing_replay=r3 replays):
per sample, the experts transformers' own full-sequence forward routes each token to, every MoE layer."""

from __future__ import annotations

import pytest
import torch

from mcpo_megatron.rollout.engines.interface import SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from mcpo_megatron.models.tiny import make_tiny_hf_model

    return make_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("moe"), seed=5)


def test_routed_experts_match_a_full_forward(model_dir):
    from transformers import AutoModelForCausalLM

    from mcpo_megatron.rollout.engines.torch.engine import TorchRolloutEngine

    engine = TorchRolloutEngine.from_pretrained(model_dir, return_routed_experts=True, max_batch_size=3)
    prompts = [[3, 17, 42], [5, 6, 7, 8, 9, 10], [100]]  # left padding in one batch, rows that stop early
    out = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=9, seed=2))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    k = model.config.num_experts_per_tok
    for s in out:
        ids = prompts[s.prompt_index] + s.token_ids[:-1]  # the last sampled token is never run
        assert s.routed_experts.shape == (len(ids), model.config.num_hidden_layers, k)
        with torch.no_grad():
            logits = model(torch.tensor([ids]), output_router_logits=True).router_logits
        for layer, z in enumerate(logits):
            want = z.topk(k, dim=-1).indices.sort(-1).values
            assert torch.equal(s.routed_experts[:, layer].long().sort(-1).values, want), (s.prompt_index, layer)


def test_dense_model_refused(tmp_path):
    from mcpo_megatron.models.tiny import make_tiny_hf_model
    from mcpo_megatron.rollout.engines.torch.engine import TorchRolloutEngine

    with pytest.raises(ValueError, match="return_routed_experts needs a mixture-of-experts model"):
        TorchRolloutEngine.from_pretrained(make_tiny_hf_model("qwen3", tmp_path, seed=0), return_routed_experts=True)
