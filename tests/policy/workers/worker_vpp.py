"""Worker (torchrun, 2 processes): PP=2 with virtual pipeline size 1 and 2, for a dense Qwen3 and a Qwen3-MoE.

Usage: worker_vpp.py OUT_DIR QWEN3_DIR MOE_DIR.  For each model and each virtual pipeline size it records the
log-probs (forward only) and the MCPO loss and gradient with one micro-batch (topped up with a filler at VPP=2)
and with one sequence per micro-batch, one optimizer step, a checkpoint round trip, and an HF export.  The
VPP=1 checkpoint is also loaded (weights only) into the VPP=2 policy.  Rank 0 writes OUT_DIR/<model>_vpp<v>.pt.
"""

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # reshard_compare.py

from common import (  # noqa: E402
    TEMPERATURE, add_weights, hf_tensors, make_batch, perturb_old_logp, policy_loss_fn, save_checkpoint,
)

from reshard_compare import plan_vs_stream  # noqa: E402
from mcpo_megatron.models.optim import OptimSettings  # noqa: E402
from mcpo_megatron.models.policy import MegatronPolicy  # noqa: E402
from mcpo_megatron.models.policy_settings import PolicySettings  # noqa: E402
from mcpo_megatron.parallel.distributed import barrier, destroy_distributed, init_distributed  # noqa: E402

BUDGETS = {"one": 10_000, "many": 16}
OPTIM = dict(lr=1e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=0.5,
             use_distributed_optimizer=False)



def run(model: str, model_dir: str, vpp: int, out_dir: Path) -> None:
    from mcpo_megatron.models.hf_export import export_hf

    info = init_distributed(1, 2, vpp=vpp, seed=0)
    res: dict = {"vpp": info.vpp}
    one = PolicySettings(logprob_chunk_size=5, temperature=TEMPERATURE, optim=OptimSettings(**OPTIM),
                         max_tokens_per_microbatch=BUDGETS["one"])
    pol = MegatronPolicy(model_dir, one, parallel_info=info)
    res["chunks"] = len(pol.model_chunks)
    export_hf(pol.model_chunks, pol.hf_config, out_dir / f"export_{model}_vpp{vpp}")
    res["plan_vs_stream"] = plan_vs_stream(pol)
    batch = make_batch(pol.vocab_size)
    for tag, budget in BUDGETS.items():
        pol.max_tokens_per_microbatch = budget
        res[f"logp_{tag}"], res[f"entropy_{tag}"] = pol.compute_logprobs(batch)
        res[f"microbatches_{tag}"] = len(pol._microbatches(batch))
    batch.token_fields["old_logp"] = perturb_old_logp(res["logp_one"])
    add_weights(batch)
    for tag, budget in BUDGETS.items():
        pol.max_tokens_per_microbatch = budget
        res[f"metrics_{tag}"] = pol.forward_backward(batch, policy_loss_fn)
        res[f"grads_{tag}"] = hf_tensors(pol, use_grad=True)
    pol.max_tokens_per_microbatch = BUDGETS["one"]  # the same single micro-batch at VPP 1 and 2
    res["step_metrics"] = pol.train_step(batch, policy_loss_fn)
    res["params_after"] = hf_tensors(pol, use_grad=False)

    ckpt = out_dir / f"ckpt_{model}_vpp{vpp}"
    save_checkpoint(pol, ckpt, info.rank)
    fresh = MegatronPolicy(model_dir, one, parallel_info=info, load_weights=False)
    fresh.load_checkpoint(ckpt)
    loaded = hf_tensors(fresh, use_grad=False)
    res["loaded_max_diff"] = max(float((loaded[k] - v).abs().max()) for k, v in res["params_after"].items())
    m2, m3 = pol.train_step(batch, policy_loss_fn), fresh.train_step(batch, policy_loss_fn)
    p2, p3 = hf_tensors(pol, use_grad=False), hf_tensors(fresh, use_grad=False)
    res["next_step"] = (m2, m3, max(float((p2[k] - p3[k]).abs().max()) for k in p2))
    if vpp == 2:  # the VPP=1 run's checkpoint, weights only, into this layout
        many = dataclasses.replace(one, max_tokens_per_microbatch=BUDGETS["many"])
        other = MegatronPolicy(model_dir, many, parallel_info=info, load_weights=False)
        other.load_checkpoint(out_dir / f"ckpt_{model}_vpp1", load_optimizer=False)
        res["cross_loaded"] = hf_tensors(other, use_grad=False)
    if info.rank == 0:
        torch.save(res, out_dir / f"{model}_vpp{vpp}.pt")
    barrier()
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


def main() -> None:
    out_dir = Path(sys.argv[1])
    for model, model_dir in (("qwen3", sys.argv[2]), ("moe", sys.argv[3])):
        for vpp in (1, 2):
            run(model, model_dir, vpp, out_dir)
    destroy_distributed()


if __name__ == "__main__":
    main()
