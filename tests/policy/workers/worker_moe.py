"""Worker (torchrun, 4 processes): a tiny Qwen3-MoE policy at EP=2, TP=2 x EP=2 (sequence parallel), PP=2 x EP=2.

Usage: worker_moe.py OUT_DIR MODEL_DIR.  For every layout it
  1. loads the HF checkpoint into bare model chunks and records the probe's logits;
  2. builds the MegatronPolicy: log-probs and entropy of the probe batch, then the MCPO gradient (several
     micro-batches per DP rank) mapped to HF names, with the step's expert-load metrics;
     at EP=2 also the gradient with the load-balancing loss (coefficient AUX_COEFF, one micro-batch per rank)
     and with full activation recomputation;
  3. runs two optimizer steps, saves a checkpoint, restores it into a randomly initialised policy and runs one
     more step on both;
  4. exports the trained policy to HF safetensors and records its log-probs (compared with transformers on the
     export by the pytest side);
  5. pushes the weights into the CPU rollout engine (HF checkpoint names, experts unfused) and records which
     tensors differ from the export, then generates and compares the engine's log-probs with the policy's.
Rank 0 writes OUT_DIR/<layout>.pt.
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
from mcpo_megatron.parallel.distributed import (  # noqa: E402
    all_gather_objects,
    barrier,
    destroy_distributed,
    init_distributed,
)

# (name, tp, pp, ep, sequence_parallel)
LAYOUTS = [("ep2", 1, 1, 2, False), ("tp2ep2", 2, 1, 2, True), ("pp2ep2", 1, 2, 2, False)]
SMALL_BUDGET = 16  # one sequence per micro-batch
BIG_BUDGET = 10_000
AUX_COEFF = 0.05
OPTIM = dict(lr=1e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=0.5)
PROMPTS = [[3, 17, 42], [5, 6, 7, 8, 9, 10], [100], [11, 12]]




def run_layout(name, tp, pp, ep, sp, out_dir: Path, model_dir: str) -> None:
    from transformers import AutoConfig

    from mcpo_megatron.models.builder import build_model_chunks
    from mcpo_megatron.models.parity import megatron_logits, probe_ids
    from mcpo_megatron.models.hf_export import export_hf
    from mcpo_megatron.models.hf_io import load_hf_weights
    from mcpo_megatron.rollout.engines.contract import policy_contract_figures
    from mcpo_megatron.rollout.engines.interface import SamplingParams, generate_data_parallel
    from mcpo_megatron.rollout.weights.resharder import Resharder
    from mcpo_megatron.rollout.engines.torch.engine import TorchRolloutEngine

    info = init_distributed(tp, pp, ep=ep, seed=0)
    res: dict = {"dp": info.dp, "ep": info.ep}
    hf_config = AutoConfig.from_pretrained(model_dir)

    # 1. logits of the loaded checkpoint
    chunks = build_model_chunks(hf_config, dtype=torch.float32, sequence_parallel=sp)
    load_hf_weights(chunks, model_dir)
    logits = megatron_logits(chunks, probe_ids(256, 2, 12, seed=0))
    gathered = all_gather_objects(logits if (info.is_last_stage and info.tp_rank == 0) else None)
    res["logits"] = next(t for t in gathered if t is not None)
    del chunks

    # 2. log-probs, then gradients
    common = dict(logprob_chunk_size=5, temperature=TEMPERATURE, sequence_parallel=sp)
    # main_grad holds the full DP-summed gradient only without the distributed optimizer (which reduce-scatters)
    plain = OptimSettings(**OPTIM, use_distributed_optimizer=False)
    pol = MegatronPolicy(model_dir, PolicySettings(optim=plain, max_tokens_per_microbatch=SMALL_BUDGET, **common),
                         parallel_info=info)
    batch = make_batch(pol.vocab_size)
    n = len(batch)
    idx, mine = shard(batch, info.dp_rank, info.dp)
    lp, ent = pol.compute_logprobs(mine)
    res["logp"] = gather_by_index(idx, lp, info, n)
    res["entropy"] = gather_by_index(idx, ent, info, n)
    batch.token_fields["old_logp"] = perturb_old_logp(res["logp"])
    add_weights(batch)
    idx, mine = shard(batch, info.dp_rank, info.dp)
    res["old_logp"] = batch.token_fields["old_logp"]
    res["metrics"] = pol.forward_backward(mine, policy_loss_fn)
    res["grads"] = hf_tensors(pol, use_grad=True)
    if name == "ep2":
        aux = MegatronPolicy(model_dir, PolicySettings(optim=plain, max_tokens_per_microbatch=BIG_BUDGET,
                                                       moe_aux_loss_coeff=AUX_COEFF, **common), parallel_info=info)
        res["aux_metrics"] = aux.forward_backward(mine, policy_loss_fn)
        res["aux_grads"] = hf_tensors(aux, use_grad=True)
        res["aux_shards"] = all_gather_objects(idx, group=info.dp_group)
        del aux
        # full activation recomputation: same gradient and expert load (each router counted once)
        rc = MegatronPolicy(model_dir, PolicySettings(optim=plain, max_tokens_per_microbatch=SMALL_BUDGET,
                                                      recompute_activations=True, **common), parallel_info=info)
        res["recompute_metrics"] = rc.forward_backward(mine, policy_loss_fn)
        res["recompute_grads"] = hf_tensors(rc, use_grad=True)
        del rc
    del pol

    # 3. two steps (distributed optimizer), checkpoint, restore into a randomly initialised policy, one more
    #    step on both
    stepping = PolicySettings(optim=OptimSettings(**OPTIM), max_tokens_per_microbatch=SMALL_BUDGET, **common)
    pol = MegatronPolicy(model_dir, stepping, parallel_info=info)
    res["step_metrics"] = pol.train_step(mine, policy_loss_fn)
    pol.train_step(mine, policy_loss_fn)
    saved = hf_tensors(pol, use_grad=False)
    ckpt = out_dir / f"ckpt_{name}"
    save_checkpoint(pol, ckpt, info.rank)
    fresh = MegatronPolicy(model_dir, stepping, parallel_info=info, load_weights=False)
    res["fresh_differs"] = max(float((v - saved[k]).abs().max()) for k, v in hf_tensors(fresh, False).items())
    fresh.load_checkpoint(ckpt)
    res["loaded_max_diff"] = max(float((v - saved[k]).abs().max()) for k, v in hf_tensors(fresh, False).items())
    m2, m3 = pol.train_step(mine, policy_loss_fn), fresh.train_step(mine, policy_loss_fn)
    p2, p3 = hf_tensors(pol, False), hf_tensors(fresh, False)
    res["next_step_metrics"] = (m2, m3)
    res["next_step_max_diff"] = max(float((p2[k] - p3[k]).abs().max()) for k in p2)
    res["next_step_moved"] = max(float((p2[k] - saved[k]).abs().max()) for k in p2)
    del fresh

    # 4. export of the trained policy, and its log-probs for the parity check
    export_dir = out_dir / f"export_{name}"
    export_hf(pol.model_chunks, pol.hf_config, export_dir)
    lp, _ = pol.compute_logprobs(mine, compute_entropy=False)
    res["trained_logp"] = gather_by_index(idx, lp, info, n)

    # 5. the rollout engine: resharded weights and the engine/trainer log-prob contract
    engine = TorchRolloutEngine(pol.hf_config, dtype=torch.float32)
    stats = Resharder(pol.model_chunks, pol.hf_config, bucket_mb=0.02, parallel_info=info).push(engine)
    res["reshard"] = dict(tensors=stats.tensors, bytes=stats.bytes)
    res["plan_vs_stream"] = plan_vs_stream(pol)
    from safetensors.torch import load_file

    exported = load_file(str(export_dir / "model.safetensors"))
    targets = {name_: (p[i] if i else p) for name_, (p, i) in engine._targets.items()}
    res["engine_vs_export_mismatch"] = sorted(k for k, t in exported.items() if not torch.equal(targets[k], t))
    res["engine_names_missing"] = sorted(set(exported) ^ set(engine.weight_names()))
    out = generate_data_parallel(engine, PROMPTS, SamplingParams(n=2, temperature=TEMPERATURE, max_new_tokens=10,
                                                                 seed=1), rollout_tp=1)
    res["contract"] = policy_contract_figures(pol, PROMPTS, out)

    if info.rank == 0:
        torch.save(res, out_dir / f"{name}.pt")
    barrier()
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


def main() -> None:
    out_dir, model_dir = Path(sys.argv[1]), sys.argv[2]
    only = sys.argv[3].split(",") if len(sys.argv) > 3 else None
    for name, tp, pp, ep, sp in LAYOUTS:
        if only is None or name in only:
            run_layout(name, tp, pp, ep, sp, out_dir, model_dir)
    destroy_distributed()


if __name__ == "__main__":
    main()
