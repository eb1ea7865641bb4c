"""R2 routing replay on a near-tie Qwen3-MoE policy (4 CPU processes: TP=2 x EP=2 with sequence parallelism,
PP=2 x EP=2, and PP=2 x VPP=2 x EP=2 with activation recomputation).

The tiny model's routers are rebuilt so that every expert's router row is the same vector plus 1e-6 times its
own: the experts' logits differ by about the rounding noise of fp32, so cutting the batch into other
micro-batches flips some tokens' choices.  ``worker_routing_replay.py`` records the routing in the old-log-prob
pass and compares the update passes with it; the references here are float64 transformers with the recorded
experts forced (the gradient with the choice held fixed).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common import TEMPERATURE, make_batch
from mp import run_ranks
from test_moe_mp import checkpoint_named

pytestmark = pytest.mark.multiproc

HERE = Path(__file__).resolve().parent
LAYOUTS = ("tp2ep2", "pp2ep2", "pp2vpp2ep2")  # and "r3"
TIE = 1e-6  # router rows w_0 + TIE * w_e: logit gaps at fp32 noise level


def near_tie_moe_model(out: Path) -> str:
    """The tiny Qwen3-MoE with every layer's router rows replaced by w_0 + TIE * w_e."""
    from safetensors.torch import load_file, save_file

    from mcpo_megatron.models.tiny import make_tiny_hf_model

    model_dir = make_tiny_hf_model("qwen3_moe", out, seed=5)
    path = Path(model_dir) / "model.safetensors"
    tensors = load_file(str(path))
    for name, w in tensors.items():
        if name.endswith("mlp.gate.weight"):
            tensors[name] = (w[0:1] + TIE * w).contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})
    return model_dir


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("replay")
    model_dir = near_tie_moe_model(out / "model")
    run_ranks(HERE / "workers" / "worker_routing_replay.py", 4, [out, model_dir], timeout=900)
    return model_dir, {name: torch.load(out / f"{name}.pt", weights_only=False) for name in LAYOUTS + ("r3",)}


def token_weights(batch):  # worker_routing_replay.token_weights
    g = torch.Generator().manual_seed(7)
    return [torch.randn(int(n), generator=g) for n in batch.response_lens]


def fixed_choice_reference(model_dir: str, record: list[torch.Tensor]):
    """float64 transformers with each token's experts taken from ``record``: per-sequence log-probs and the
    checkpoint-named gradient of sum(w * logp)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe import modeling_qwen3_moe as hf

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="eager",
                                                 experts_implementation="eager")
    batch = make_batch(model.config.vocab_size)
    weights = token_weights(batch)
    layer_of = {m: i for i, layer in enumerate(model.model.layers) for m in [layer.mlp.gate]}
    current: list[torch.Tensor] = []

    def replayed_router(self, hidden_states):
        logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        chosen = current[0][:, layer_of[self]].long()
        scores = torch.softmax(logits.gather(1, chosen), dim=-1)  # norm_topk_prob: softmax over the chosen
        return logits, scores, chosen

    logps, loss = [], 0.0
    original = hf.Qwen3MoeTopKRouter.forward
    hf.Qwen3MoeTopKRouter.forward = replayed_router
    try:
        for i, ids in enumerate(batch.input_ids):
            p, r = int(batch.prompt_lens[i]), int(batch.response_lens[i])
            current[:] = [record[i]]
            logits = model(ids[None]).logits[0]
            lsm = torch.log_softmax(logits[p - 1: p + r - 1] / TEMPERATURE, dim=-1)
            lp = lsm.gather(-1, ids[p: p + r, None]).squeeze(-1)
            logps.append(lp.detach())
            loss = loss + (lp * weights[i].double()).sum()
        loss.backward()
    finally:
        hf.Qwen3MoeTopKRouter.forward = original
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logps, checkpoint_named(model, grads)


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((float((x.double() - y.double()).abs().max()) for x, y in zip(a, b) if x.numel()), default=0.0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_record_covers_every_token_and_layer(run, layout):
    model_dir, res = run
    batch = make_batch(256)
    for ids, rec in zip(batch.input_ids, res[layout]["record"]):
        assert rec.shape == (ids.numel(), 4, 2)  # 4 MoE layers, top-2
        assert int(rec.min()) >= 0 and int(rec.max()) < 4
        assert bool((rec[..., 0] != rec[..., 1]).all())


def flipped(res) -> bool:
    """Whether the pass over other micro-batch shapes, without replay, chose other experts anywhere. Without tensor
    parallelism that depends on the CPU's matmul kernels: some give every row the same bits whatever the number of
    rows (then nothing flips and there is nothing to replay), others do not. With TP=2 the partial sums' reduction
    order changes with the shape on every CPU seen."""
    return res["plain_metrics"]["moe/routing_mismatch_frac"] > 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_near_ties_flip_without_replay(run, layout):
    """Other micro-batch shapes, no replay: some (token, layer) choices flip, and a log-prob moves by > 1e-2;
    where this CPU's kernels flip none, the two passes are the same model to fp32 noise."""
    res = run[1][layout]
    assert flipped(res) or layout != "tp2ep2"
    if flipped(res):
        assert max_diff(res["old_logp"], res["plain_logp"]) > 1e-2
    else:
        assert max_diff(res["old_logp"], res["plain_logp"]) < 2e-6


@pytest.mark.parametrize("layout", LAYOUTS)
def test_replay_reproduces_old_logprobs(run, layout):
    """With replay the update pass's log-probs are the old pass's: to the micro-batch shape's fp32 noise (2e-6)
    over other micro-batches, bitwise over the same ones (the trainer's case)."""
    res = run[1][layout]
    # replay had choices to override (where the kernels flipped some)
    assert (res["replay_metrics"]["moe/routing_mismatch_frac"] > 0) == flipped(res)
    assert max_diff(res["old_logp"], res["replay_logp"]) < 2e-6
    assert all(torch.equal(a, b) for a, b in zip(res["old_logp"], res["same_replay_logp"]))
    assert res["same_replay_metrics"]["moe/routing_mismatch_frac"] == 0.0


@pytest.fixture(scope="module")
def references(run):
    model_dir, res = run
    return {layout: fixed_choice_reference(model_dir, res[layout]["record"]) for layout in LAYOUTS}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_replay_is_the_fixed_choice_model(run, references, layout):
    """Log-probs and gradient under replay are those of float64 transformers with the recorded experts forced;
    the router's weights get a gradient (it learns through the chosen experts' logits)."""
    res = run[1][layout]
    ref_logp, ref_grads = references[layout]
    assert max_diff(res["replay_logp"], ref_logp) < 2e-5
    assert max_diff(res["old_logp"], ref_logp) < 2e-5
    if flipped(res):
        assert max_diff(res["plain_logp"], ref_logp) > 1e-2  # the flipped choice is another model
    grads = res["grads"]
    assert set(grads) == set(ref_grads)
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    for name, ref in ref_grads.items():
        assert float((grads[name].double() - ref).abs().max()) < 1e-5 * scale, name
    router = [n for n in ref_grads if n.endswith("mlp.gate.weight")]
    assert router and all(float(ref_grads[n].abs().max()) > 0 for n in router)


def test_r3_replays_the_engines_routing(run):
    """R3 at TP=2 x EP=2 (SP): the PyTorch engine's samples, scored by the trainer with its own routing (some
    choices differ from the engine's, log-probs far off) and with the engine's replayed (fp32 agreement)."""
    res = run[1]["r3"]
    for (prompt, tokens), routed in zip(res["samples"], res["routed"]):
        assert routed.shape == (len(prompt) + len(tokens) - 1, 4, 2)
    engine = [torch.tensor(x, dtype=torch.float64) for x in res["engine_logp"]]
    assert res["plain_metrics"]["moe/routing_mismatch_frac"] > 0.01
    assert max_diff(engine, res["plain_logp"]) > 1e-2
    assert max_diff(engine, res["replay_logp"]) < 1e-5
    c = res["contract"]  # mcpo check-rollout's figures: without replay, then with
    assert c["routing_mismatch"] > 0.01 and c["max_abs_diff"] > 1e-2 and c["replay_max_abs_diff"] < 1e-5
