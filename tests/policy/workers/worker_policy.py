"""Worker (run under torchrun, 4 processes): MegatronPolicy at TP2xPP2, TP2 (DP2) and PP2 (DP2).

Usage: worker_policy.py OUT_DIR MODEL_DIR TIED_DIR [LAYOUT,...].  For every layout it
  1. computes log-probs and entropy of the probe batch (each DP rank its share);
  2. perturbs them into old_logp, adds the global MCPO weights, and runs forward-backward
     with 1 micro-batch per DP rank and with 4+ (token budget) - gradients mapped to HF names;
  3. runs one train_step with the distributed optimizer and records the HF-named params;
  4. saves a checkpoint, restores it into a freshly initialised policy, and checks that
     the parameters and the next step agree.
Rank 0 writes OUT_DIR/<layout>.pt; the pytest side compares with transformers.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # reshard_compare.py

from common import (  # noqa: E402
    TEMPERATURE, add_weights, gather_by_index, hf_tensors, make_batch, perturb_old_logp, policy_loss_fn,
    save_checkpoint, shard,
)

from reshard_compare import plan_vs_stream  # noqa: E402
from mcpo_megatron.models.optim import OptimSettings  # noqa: E402
from mcpo_megatron.models.policy import MegatronPolicy  # noqa: E402
from mcpo_megatron.models.policy_settings import PolicySettings  # noqa: E402
from mcpo_megatron.parallel.distributed import barrier, destroy_distributed, init_distributed  # noqa: E402

# (name, tp, pp, model): "qwen3" is MODEL_DIR, "tied" is TIED_DIR (Llama with tied embeddings,
# whose output layer on the last stage is the first stage's embedding).
LAYOUTS = [("tp2pp2", 2, 2, "qwen3"), ("tp2", 2, 1, "qwen3"), ("pp2", 1, 2, "qwen3"),
           ("tied_tp2pp2", 2, 2, "tied"), ("pp2_overlap", 1, 2, "qwen3")]
# Layouts with megatron DDP's overlapped gradient reduction and (distributed optimizer) parameter all-gather.
OVERLAP = {"pp2_overlap"}
BIG_BUDGET = 10_000  # everything in one micro-batch
SMALL_BUDGET = 16  # every sequence (length 7..15) alone: 4+ micro-batches per DP rank
OPTIM = dict(lr=1e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=0.5)




def run_layout(name, tp, pp, out_dir: Path, model_dir: str) -> None:
    info = init_distributed(tp, pp, seed=0)
    common = dict(logprob_chunk_size=5, temperature=TEMPERATURE)
    overlap = name in OVERLAP
    pol = MegatronPolicy(model_dir, PolicySettings(optim=OptimSettings(**OPTIM, use_distributed_optimizer=False),
                                                   max_tokens_per_microbatch=BIG_BUDGET, overlap_grad_reduce=overlap,
                                                   **common), parallel_info=info)
    stepping = PolicySettings(optim=OptimSettings(**OPTIM, use_distributed_optimizer=True),
                              max_tokens_per_microbatch=SMALL_BUDGET, overlap_grad_reduce=overlap,
                              overlap_param_gather=overlap, **common)
    batch = make_batch(pol.vocab_size)
    n = len(batch)
    idx, mine = shard(batch, info.dp_rank, info.dp)

    # 1. log-probs and entropy
    lp, ent = pol.compute_logprobs(mine)
    logp_all = gather_by_index(idx, lp, info, n)
    ent_all = gather_by_index(idx, ent, info, n)
    res = {"logp": logp_all, "entropy": ent_all, "dp": info.dp}
    lp_only, no_ent = pol.compute_logprobs(mine, compute_entropy=False)
    res["logp_only_max_diff"] = max(float((a - b).abs().max(), ) if a.numel() else 0.0 for a, b in zip(lp_only, lp))
    res["no_entropy_is_none"] = no_ent is None

    # 2. gradients with 1 and with 4+ micro-batches
    batch.token_fields["old_logp"] = perturb_old_logp(logp_all)
    add_weights(batch)
    idx, mine = shard(batch, info.dp_rank, info.dp)
    res["old_logp"] = batch.token_fields["old_logp"]
    for tag, budget in (("one", BIG_BUDGET), ("many", SMALL_BUDGET)):
        pol.max_tokens_per_microbatch = budget
        metrics = pol.forward_backward(mine, policy_loss_fn)
        res[f"metrics_{tag}"] = metrics
        res[f"grads_{tag}"] = hf_tensors(pol, use_grad=True)
    del pol

    # 3. one optimizer step (distributed optimizer)
    pol2 = MegatronPolicy(model_dir, stepping, parallel_info=info)
    res["step_metrics"] = pol2.train_step(mine, policy_loss_fn)
    if overlap:  # the step updated this rank's shard; the all-gather of the others waits for sync_params
        local = [p.detach().clone() for c in pol2.model_chunks for p in c.parameters()]
        pol2.sync_params()
        res["sync_changed"] = max(float((p - q).abs().max()) for p, q in
                                  zip((p for c in pol2.model_chunks for p in c.parameters()), local))
    res["params_after"] = hf_tensors(pol2, use_grad=False)
    res["plan_vs_stream"] = plan_vs_stream(pol2)

    # 4. checkpoint round trip into a randomly initialised policy, then one more step on both.
    # A second step first: the restored Adam step count (2) then differs from the placeholder
    # state a fresh optimizer is given before loading (1), so a lost step count shows.
    pol2.train_step(mine, policy_loss_fn)
    saved = hf_tensors(pol2, use_grad=False)
    ckpt = out_dir / f"ckpt_{name}"
    save_checkpoint(pol2, ckpt, info.rank)
    pol3 = MegatronPolicy(model_dir, stepping, parallel_info=info, load_weights=False)
    fresh = hf_tensors(pol3, use_grad=False)
    res["fresh_differs"] = max(float((fresh[k] - saved[k]).abs().max()) for k in fresh)
    pol3.load_checkpoint(ckpt, load_optimizer=False)  # weights only (export / eval path)
    loaded = hf_tensors(pol3, use_grad=False)
    res["weights_only_max_diff"] = max(float((loaded[k] - saved[k]).abs().max()) for k in loaded)
    pol3.load_checkpoint(ckpt)
    loaded = hf_tensors(pol3, use_grad=False)
    res["loaded_max_diff"] = max(float((loaded[k] - saved[k]).abs().max()) for k in loaded)
    res["loaded_lr"] = pol3.scheduler.get_lr(pol3.optimizer.param_groups[0])
    res["orig_lr"] = pol2.scheduler.get_lr(pol2.optimizer.param_groups[0])
    m2 = pol2.train_step(mine, policy_loss_fn)
    m3 = pol3.train_step(mine, policy_loss_fn)
    p2, p3 = hf_tensors(pol2, use_grad=False), hf_tensors(pol3, use_grad=False)
    res["next_step_metrics"] = (m2, m3)
    res["next_step_max_diff"] = max(float((p2[k] - p3[k]).abs().max()) for k in p2)
    res["next_step_moved"] = max(float((p2[k] - saved[k]).abs().max()) for k in p2)

    # 5. a non-finite loss on one DP rank skips the update everywhere
    def nan_loss_fn(logp, entropy, mb):
        loss, sums = policy_loss_fn(logp, entropy, mb)
        return (loss * float("nan") if info.dp_rank == info.dp - 1 else loss), sums

    lr_before = pol2.optimizer.param_groups[0]["lr"]
    res["nan_step_metrics"] = pol2.train_step(mine, nan_loss_fn)
    p_nan = hf_tensors(pol2, use_grad=False)
    res["nan_step_max_diff"] = max(float((p_nan[k] - p2[k]).abs().max()) for k in p2)
    res["nan_step_lr_kept"] = pol2.optimizer.param_groups[0]["lr"] == lr_before

    if info.rank == 0:
        torch.save(res, out_dir / f"{name}.pt")
    barrier()
    # Keep the default process group (re-creating it would reuse the rendezvous port);
    # only megatron's model-parallel groups change between layouts.
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


def main() -> None:
    out_dir, dirs = Path(sys.argv[1]), {"qwen3": sys.argv[2], "tied": sys.argv[3]}
    only = sys.argv[4].split(",") if len(sys.argv) > 4 else None
    for name, tp, pp, model in LAYOUTS:
        if only is None or name in only:
            run_layout(name, tp, pp, out_dir, dirs[model])
    destroy_distributed()


if __name__ == "__main__":
    main()
