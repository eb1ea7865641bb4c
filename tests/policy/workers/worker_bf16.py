"""Worker (torchrun): MegatronPolicy in bf16 (the GPU default dtype) at TP = the number of processes (2 in the
CPU test and on two GPUs, 1 in the GPU kit's one-GPU parity check).

Usage: worker_bf16.py OUT_DIR MODEL_DIR.  Computes log-probs, then one train_step with the
distributed optimizer (fp32 master weights, bf16 model weights); rank 0 writes OUT_DIR/bf16.pt.
"""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # reshard_compare.py

from common import TEMPERATURE, add_weights, make_batch, perturb_old_logp, policy_loss_fn  # noqa: E402
from worker_policy import hf_tensors  # noqa: E402

from reshard_compare import plan_vs_stream  # noqa: E402
from mcpo_megatron.models.optim import OptimSettings  # noqa: E402
from mcpo_megatron.models.policy import MegatronPolicy  # noqa: E402
from mcpo_megatron.models.policy_settings import PolicySettings  # noqa: E402
from mcpo_megatron.parallel.distributed import barrier, destroy_distributed, init_distributed  # noqa: E402

LR = 1e-2


def main() -> None:
    out_dir, model_dir = Path(sys.argv[1]), sys.argv[2]
    info = init_distributed(int(os.environ["WORLD_SIZE"]), 1, seed=0)
    pol = MegatronPolicy(model_dir, PolicySettings(dtype=torch.bfloat16, temperature=TEMPERATURE,
                                                   optim=OptimSettings(lr=LR, weight_decay=0.0, clip_grad=0.0),
                                                   max_tokens_per_microbatch=64), parallel_info=info)
    batch = make_batch(pol.vocab_size)
    logp, ent = pol.compute_logprobs(batch)
    batch.token_fields["old_logp"] = perturb_old_logp(logp)
    add_weights(batch)
    before = hf_tensors(pol, use_grad=False)
    metrics = pol.train_step(batch, policy_loss_fn)
    after = hf_tensors(pol, use_grad=False)
    plan = plan_vs_stream(pol, dtype=torch.bfloat16)
    if info.rank == 0:
        torch.save({"logp": logp, "entropy": ent, "old_logp": batch.token_fields["old_logp"],
                    "metrics": metrics, "before": before, "after": after, "tp": info.tp, "device": str(info.device),
                    "param_dtype": str(next(pol.model.parameters()).dtype),
                    "plan_vs_stream": plan}, out_dir / "bf16.pt")
    barrier()
    destroy_distributed()


if __name__ == "__main__":
    main()
