"""FLOPs accounting against a hand count and against torch's FLOP counter on a plain implementation."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mcpo_megatron import accounting as acc

# A tiny GQA SwiGLU decoder: 2 layers, hidden 8, 2 query heads and 1 KV head of size 4, FFN 12, vocab 10.
TINY = dict(num_layers=2, hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
            ffn_hidden_size=12, vocab_size=10)


def test_hand_count_mixture_of_experts():
    """A MoE layer counts the experts a token visits (k of E) and its router instead of the dense MLP."""
    moe = dict(TINY, num_experts=4, num_experts_per_tok=2, moe_ffn_hidden_size=6)
    # attention 384 per layer (q 128 + k, v 128 + o 128); experts 2 x 3 x 2 x 8 x 6 = 576; router 2 x 8 x 4 = 64
    assert acc.linear_flops_per_token(moe) == 2 * (384 + 576 + 64)
    assert acc.linear_flops_per_token(TINY) == 2 * 960


def test_hand_count_hybrid_decoder():
    """A hybrid decoder: 3 layers, full attention every 3rd. The attention layer gains the output gate's share of
    the query projection (+128); a Gated DeltaNet layer (2 key heads of 3, 4 value heads of 2: qk = 6, v = 8)
    counts its input projection 2 x 8 x (12 + 16 + 8) = 576, the delta rule 3 x 2 x 4 x 3 x 2 = 144 and its output
    projection 2 x 8 x 8 = 128; only the attention layer has score and context terms; the MoE form adds the
    shared expert 3 x 2 x 8 x 5 = 240 and its gate 16 to every layer."""
    hybrid = dict(TINY, num_layers=3, layer_types=["linear_attention", "linear_attention", "full_attention"],
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=3, linear_value_head_dim=2,
                  linear_conv_kernel_dim=4)
    assert acc.linear_flops_per_token(hybrid) == 2 * (576 + 144 + 128 + 576) + (960 + 128)
    assert acc.attention_flops(hybrid, 5) == acc.attention_flops(TINY, 5) / 2
    moe = dict(hybrid, num_experts=4, num_experts_per_tok=2, moe_ffn_hidden_size=6, shared_expert_ffn_hidden_size=5)
    assert acc.linear_flops_per_token(moe) == (2 * (576 + 144 + 128) + (384 + 128)
                                               + 3 * (576 + 64 + 240 + 16))


def test_hand_count_tiny_shape():
    # Per layer and token (2 FLOPs per multiply-accumulate):
    #   q: [8] x [8, 2*4] -> 2*8*8 = 128;  k, v: [8] x [8, 1*4] each -> 2*(2*8*4) = 128
    #   o: [2*4] x [8, 8] -> 128;          gate, up: [8] x [8, 12] each, down: [12] x [12, 8] -> 3*2*8*12 = 576
    #   => 960 per layer, 1920 for the 2 layers.
    # Attention per (query, key) pair per layer: q.k over 2 heads of 4 -> 2*8 = 16, a.v the same -> 32;
    #   2 layers -> 64 per pair.
    # LM head per logit row: [8] x [8, 10] -> 160.
    # One sequence of prompt 3 + response 2 = 5 tokens; causal pairs 1+2+3+4+5 = 15.
    forward = 5 * 1920 + 15 * 64 + 5 * 160
    assert forward == 11360
    kw = dict(prompt_lens=[3], response_lens=[2])
    assert acc.model_flops(TINY, kind="logprob", **kw) == forward
    assert acc.model_flops(TINY, kind="train", **kw) == 3 * forward
    # Generation: prefill 3 prompt tokens, then 1 decode step feeding response token 0 (token 1 is sampled
    # from it and never fed back): 4 processed positions, causal pairs 1+2+3+4 = 10, logits at 2 positions.
    assert acc.model_flops(TINY, kind="generate", **kw) == 4 * 1920 + 10 * 64 + 2 * 160
    # Non-causal convention (PaLM): the full 5 x 5 square.
    assert acc.model_flops(TINY, kind="logprob", causal=False, **kw) == 5 * 1920 + 25 * 64 + 5 * 160
    # A batch is the sum of its sequences; uniform batches can be given as ints.
    two = acc.model_flops(TINY, kind="train", prompt_lens=[3, 3], response_lens=[2, 2])
    assert two == 6 * forward
    assert acc.model_flops(TINY, kind="train", prompt_lens=3, response_lens=2, num_sequences=2) == two


class PlainDecoder(torch.nn.Module):
    """A float64 GQA + SwiGLU decoder written with explicit matmuls (an independent reference)."""

    def __init__(self, s: dict):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        h, a, k, d, f = (s[n] for n in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                         "ffn_hidden_size"))
        self.a, self.k, self.d = a, k, d

        def w(*shape):
            return torch.nn.Parameter(torch.randn(*shape, generator=g, dtype=torch.float64) * 0.3)

        self.layers = [dict(q=w(h, a * d), k=w(h, k * d), v=w(h, k * d), o=w(a * d, h), gate=w(h, f), up=w(h, f),
                            down=w(f, h)) for _ in range(s["num_layers"])]
        self.head = w(h, s["vocab_size"])
        self.params = [p for layer in self.layers for p in layer.values()] + [self.head]

    def forward(self, x, cache=None, logits_last=None):
        """x [S, h]; cache: per layer (K, V) [heads, T, d] extended in place (decode) or None (full causal)."""
        S = x.shape[0]
        for i, L in enumerate(self.layers):
            q = (x @ L["q"]).view(S, self.a, self.d).transpose(0, 1)
            kk = (x @ L["k"]).view(S, self.k, self.d).transpose(0, 1)
            vv = (x @ L["v"]).view(S, self.k, self.d).transpose(0, 1)
            if cache is not None:
                if len(cache) > i:
                    kk = torch.cat([cache[i][0], kk], 1)
                    vv = torch.cat([cache[i][1], vv], 1)
                    cache[i] = (kk, vv)
                else:
                    cache.append((kk, vv))
            rep = self.a // self.k
            kk, vv = kk.repeat_interleave(rep, 0), vv.repeat_interleave(rep, 0)
            T = kk.shape[1]
            # Causal: query j (absolute T - S + j) sees keys 0..T-S+j. Computed per query row so that the
            # FLOP counter sees only the allowed pairs.
            ctx = []
            for j in range(S):
                n = T - S + j + 1
                sc = q[:, j:j + 1] @ kk[:, :n].transpose(1, 2)
                ctx.append(torch.softmax(sc, -1) @ vv[:, :n])
            attn = torch.cat(ctx, 1).transpose(0, 1).reshape(S, self.a * self.d)
            x = x + attn @ L["o"]
            x = x + (torch.nn.functional.silu(x @ L["gate"]) * (x @ L["up"])) @ L["down"]
        return (x if logits_last is None else x[-logits_last:]) @ self.head


def _count(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("prompt,response", [(3, 2), (5, 4), (1, 1)])
def test_against_torch_flop_counter(prompt, response):
    model = PlainDecoder(TINY)
    S = prompt + response
    x = torch.randn(S, TINY["hidden_size"], dtype=torch.float64)
    kw = dict(prompt_lens=[prompt], response_lens=[response])

    fwd = _count(lambda: model(x))
    assert fwd == acc.model_flops(TINY, kind="logprob", **kw)

    def fwd_bwd():
        # x needs a gradient so that every forward matmul has its two backward matmuls (3x forward), as in a
        # decoder where the embeddings are trained.
        model(x.detach().requires_grad_(True)).sum().backward()

    assert _count(fwd_bwd) == acc.model_flops(TINY, kind="train", **kw)

    def generate():
        cache: list = []
        model(x[:prompt], cache=cache, logits_last=1)       # prefill, logits of the last prompt token
        for t in range(response - 1):                       # feed sampled tokens 0 .. R-2
            model(x[prompt + t: prompt + t + 1], cache=cache, logits_last=1)

    assert _count(generate) == acc.model_flops(TINY, kind="generate", **kw)


def test_shape_object_and_errors():
    from mcpo_megatron.config import ModelShape

    shape = ModelShape(max_position_embeddings=None, tie_word_embeddings=False, family=None, source="test", **TINY)
    assert acc.model_flops(shape, kind="train", prompt_lens=[3], response_lens=[2]) == 3 * 11360
    with pytest.raises(ValueError, match="kind='sample'"):
        acc.model_flops(shape, kind="sample", prompt_lens=[3], response_lens=[2])
    with pytest.raises(ValueError, match="prompt_lens has 2 sequences"):
        acc.model_flops(shape, kind="train", prompt_lens=[3, 3], response_lens=[2])
    with pytest.raises(ValueError, match="hidden_size=0"):
        acc.model_flops({**TINY, "hidden_size": 0}, kind="train", prompt_lens=[1], response_lens=[1])
    with pytest.raises(ValueError, match="peak"):
        acc.mfu(1.0, 0.0)


def test_qwen3_8b_matches_six_n_rule():
    # For short sequences, training FLOPs per token approach 6 x (matmul parameters): a sanity check of the
    # per-layer terms against Qwen3-8B's published parameter count (8.19B with embeddings; 36 layers).
    q8 = dict(num_layers=36, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
              ffn_hidden_size=12288, vocab_size=151936)
    per_layer_params = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 12288
    matmul_params = 36 * per_layer_params + 4096 * 151936
    flops = acc.model_flops(q8, kind="train", prompt_lens=[1], response_lens=[0])
    attention = 3 * 36 * 4 * 32 * 128 * 1
    assert flops == 6 * matmul_params + attention
    assert 7.5e9 < matmul_params < 8.2e9


def test_mfu_and_step_accounting():
    assert acc.mfu(494.5e12) == pytest.approx(0.5)
    assert acc.mfu(1e12, peak=2e12) == pytest.approx(0.5)
    record = {"time/step": 2.0, "time/train": 0.5, "time/rollout": 1.0, "time/old_logprobs": 0.25}
    out = acc.step_accounting(TINY, record, acc.StepWork([3, 3], [2, 2]),
                              acc.StepDevices(2, on_gpu=True, peak_flops=1e5), peak_bytes=3 * acc.GIB)
    train, logprob, gen = 2 * 34080, 2 * 11360, 2 * 8640
    assert out["perf/train_tflops"] == pytest.approx(train / 1e12)
    assert out["perf/step_tflops"] == pytest.approx((train + logprob + gen) / 1e12)
    assert out["perf/tokens_per_s_per_gpu"] == pytest.approx(10 / 2.0 / 2)
    per_gpu = (train + logprob + gen) / 2.0 / 2
    assert out["perf/achieved_tflops_per_s_per_gpu"] == pytest.approx(per_gpu / 1e12)
    assert out["perf/mfu"] == pytest.approx(per_gpu / 1e5)
    assert out["perf/train_mfu"] == pytest.approx(train / 0.5 / 2 / 1e5)
    assert out["perf/rollout_achieved_tflops_per_s_per_gpu"] == pytest.approx(gen / 1.0 / 2 / 1e12)
    assert out["memory/peak_gib"] == 3.0
    cpu = acc.step_accounting(TINY, record, acc.StepWork([3], [2], ppo_epochs=2), acc.StepDevices(2, on_gpu=False),
                              peak_bytes=0)
    assert "perf/mfu" not in cpu and "perf/train_mfu" not in cpu
    assert cpu["perf/train_tflops"] == pytest.approx(2 * 34080 / 1e12)
    # Dynamic sampling: generation counted over what was generated, training over what was kept.
    ds = acc.step_accounting(TINY, record, acc.StepWork([3], [2], gen_prompt_lens=[3, 3], gen_response_lens=[2, 2]),
                             acc.StepDevices(1, on_gpu=False), peak_bytes=0)
    assert ds["perf/rollout_tflops"] == pytest.approx(2 * 8640 / 1e12)
    # the reference KL's frozen policy: a second forward pass over the trained sequences
    kl = acc.step_accounting(TINY, record, acc.StepWork([3], [2], logprob_passes=2), acc.StepDevices(1, on_gpu=False),
                             peak_bytes=0)
    assert kl["perf/old_logprob_tflops"] == pytest.approx(2 * cpu["perf/old_logprob_tflops"])
    with pytest.raises(ValueError, match=r"world_size=0: must be >= 1"):
        acc.StepDevices(0)


def test_generated_tokens_per_second_of_generation_and_of_the_step():
    """The generation rate is over the generation time (eval and training excluded); the whole-step figure has
    its own name."""
    record = {"time/step": 10.0, "time/train": 3.0, "time/rollout": 2.0, "time/eval": 4.0}
    work = acc.StepWork([3], [2], gen_prompt_lens=[3, 3, 3], gen_response_lens=[5, 7, 8])
    out = acc.step_accounting(TINY, record, work, acc.StepDevices(2, on_gpu=False), peak_bytes=0)
    assert out["perf/generated_tokens_per_s"] == pytest.approx(20 / 2.0)
    assert out["perf/generated_tokens_per_step_s"] == pytest.approx(20 / 10.0)


def test_separate_placement_counts_each_phase_on_its_own_devices():
    """Engines on 1 rank of their own beside 3 trainer ranks: generation over the engines' seconds on 1 device,
    training on 3, the step on all 4."""
    record = {"time/step": 2.0, "time/train": 0.5, "time/rollout": 1.5, "time/engine_generate": 0.25,
              "time/old_logprobs": 0.25}
    devices = acc.StepDevices(4, train_world_size=3, rollout_world_size=1,
                              generation_time_key="time/engine_generate", on_gpu=True, peak_flops=1e5)
    out = acc.step_accounting(TINY, record, acc.StepWork([3], [2]), devices, peak_bytes=0)
    train, logprob, gen = 34080, 11360, 8640
    assert out["perf/rollout_achieved_tflops_per_s_per_gpu"] == pytest.approx(gen / 0.25 / 1 / 1e12)
    assert out["perf/train_achieved_tflops_per_s_per_gpu"] == pytest.approx(train / 0.5 / 3 / 1e12)
    assert out["perf/old_logprob_achieved_tflops_per_s_per_gpu"] == pytest.approx(logprob / 0.25 / 3 / 1e12)
    assert out["perf/train_mfu"] == pytest.approx(train / 0.5 / 3 / 1e5)
    assert out["perf/achieved_tflops_per_s_per_gpu"] == pytest.approx((train + logprob + gen) / 2.0 / 4 / 1e12)
    assert out["perf/generated_tokens_per_s"] == pytest.approx(2 / 0.25)  # not over the trainer's wait (1.5 s)


def test_peak_memory_is_plausible():
    rss = acc.peak_memory_bytes()
    assert 10 * 2 ** 20 < rss < 64 * acc.GIB  # a python process with torch loaded: tens of MiB at least
    assert acc.peak_memory_bytes(all_ranks=True) >= rss  # no process group: the local value


def test_write_summary(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_NUM_NODES", raising=False)
    monkeypatch.delenv("SLURM_NNODES", raising=False)
    records = [
        {"step": 1, "time/step": 10.0, "perf/tokens_per_s_per_gpu": 1.0, "memory/peak_gib": 1.0,
         "acc/mean": 0.1, "batch/sequences": 4, "perf/step_tflops": 0.5},
        {"step": 2, "time/step": 4.0, "perf/tokens_per_s_per_gpu": 3.0, "memory/peak_gib": 2.5,
         "acc/mean": 0.2, "batch/sequences": 4, "perf/step_tflops": 0.5},
        {"step": 3, "time/step": 6.0, "perf/tokens_per_s_per_gpu": 5.0, "memory/peak_gib": 2.0,
         "acc/mean": 0.4, "batch/sequences": 4, "perf/step_tflops": 0.5, "retention/acc": "nan"},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    path = acc.write_summary(tmp_path, warmup_steps=1, world_size=2)
    s = json.loads(path.read_text())
    assert s["steps"] == 3 and s["warmup_steps"] == 1 and s["nodes"] == 1 and s["world_size"] == 2
    assert s["mean"]["time/step"] == pytest.approx(5.0)
    assert s["mean"]["perf/tokens_per_s_per_gpu"] == pytest.approx(4.0)
    assert s["max"]["memory/peak_gib"] == 2.5
    assert s["total"] == {"time_s": 20.0, "sequences": 12.0, "tflops": 1.5}
    assert s["final"]["acc/mean"] == 0.4 and "retention/acc" not in s["final"]
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "4")
    assert json.loads(acc.write_summary(tmp_path).read_text())["nodes"] == 4
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        acc.write_summary(tmp_path / "missing")


PEAK_WORKER = """
import json, sys
import numpy as np
import torch.distributed as dist
from mcpo_megatron import accounting as acc

dist.init_process_group("gloo")
rank = dist.get_rank()
if rank == 1:  # touch 300 MiB more than rank 0 so that the maximum is rank 1's
    big = np.ones(300 * 2 ** 20 // 8)
local = acc.peak_memory_bytes()
gathered = [None, None]
dist.all_gather_object(gathered, local)
both = acc.peak_memory_bytes(all_ranks=True)
json.dump({"local": gathered, "max": both}, open(sys.argv[1] + f"/rank{rank}.json", "w"))
dist.barrier()  # gloo aborts ("terminate called") when one rank tears down while the other still sends
dist.destroy_process_group()
"""


@pytest.mark.multiproc
def test_peak_memory_max_over_ranks(tmp_path):
    from mp import run_ranks

    script = tmp_path / "worker.py"
    script.write_text(PEAK_WORKER)
    run_ranks(script, 2, [str(tmp_path)], timeout=240)
    r0, r1 = (json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2))
    assert r1["local"][1] > r0["local"][0] + 200 * 2 ** 20
    assert r0["max"] == r1["max"] >= max(r0["local"])
