"""Worker (torchrun, 2 processes): training steps with the state offloaded to host memory between them against
the same steps without, in three layouts.

Usage: worker_offload.py OUT_DIR QWEN3_DIR MOE_DIR.  Layouts (each a fresh megatron state):

* ``dp2``: dense Qwen3 in bf16, DP=2, distributed optimizer (fp32 master weights and Adam moments sharded over
  DP), overlapped grad reduce-scatter and param all-gather, and a frozen reference policy;
* ``vpp``: PP=2 with two virtual stages (two model chunks, two DDP wrappers), distributed optimizer, overlapped
  grad reduce;
* ``ep``: Qwen3-MoE at EP=2 (expert-parallel DDP buffers, the chained dense + expert optimizer).

In each, policy A runs STEPS train steps, and between them its state goes through what a colocated run does:
everything but the weights offloaded, then the weights (after a weight update would have read them), the
storages checked released, then everything back; policy B runs the same steps without. Rank 0 writes
OUT_DIR/<layout>.pt: both runs' metrics, weights (via the HF mapping), the optimizer state, the storage sizes seen
while offloaded, and the reference's log-probs before and after.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py

from common import TEMPERATURE, add_weights, hf_tensors, make_batch, perturb_old_logp, policy_loss_fn  # noqa: E402

from mcpo_megatron.models.offload import StateOffload, policy_tensors  # noqa: E402
from mcpo_megatron.models.optim import OptimSettings  # noqa: E402
from mcpo_megatron.models.policy import MegatronPolicy  # noqa: E402
from mcpo_megatron.models.policy_settings import PolicySettings  # noqa: E402
from mcpo_megatron.parallel.distributed import barrier, destroy_distributed, init_distributed  # noqa: E402

STEPS = 3
LAYOUTS = {
    "dp2": dict(tp=1, pp=1, vpp=None, ep=1, model="qwen3", dtype=torch.bfloat16, overlap_param_gather=True,
                reference=True),
    "vpp": dict(tp=1, pp=2, vpp=2, ep=1, model="qwen3", dtype=torch.float32, overlap_param_gather=False,
                reference=False),
    "ep": dict(tp=1, pp=1, vpp=None, ep=2, model="moe", dtype=torch.float32, overlap_param_gather=False,
               reference=False),
}


def optimizer_state(pol) -> list[torch.Tensor]:
    """This rank's master weights and moments, as copies in a fixed order."""
    t = policy_tensors(pol)
    return [x.detach().clone() for x in t["master_weights"] + t["moments"]]


def storage_sizes(tensors) -> list[int]:
    return [t.untyped_storage().nbytes() for t in tensors]


def run(name: str, model_dir: str, out_dir: Path) -> None:
    from mcpo_megatron.models.reference import ReferencePolicy

    lay = LAYOUTS[name]
    info = init_distributed(lay["tp"], lay["pp"], vpp=lay["vpp"], ep=lay["ep"], seed=0)
    optim = OptimSettings(lr=1e-2, weight_decay=0.1, clip_grad=1.0, use_distributed_optimizer=True)
    settings = PolicySettings(dtype=lay["dtype"], temperature=TEMPERATURE, optim=optim, max_tokens_per_microbatch=24,
                              overlap_grad_reduce=True, overlap_param_gather=lay["overlap_param_gather"])
    res: dict = {"layout": name, "chunks": 0}
    for run_name in ("offloaded", "resident"):
        pol = MegatronPolicy(model_dir, settings, parallel_info=info)
        ref = ReferencePolicy(model_dir, settings, parallel_info=info) if lay["reference"] else None
        offload = StateOffload(pol, ref) if run_name == "offloaded" else None
        res["chunks"] = len(pol.model_chunks)
        res["initial"] = hf_tensors(pol, use_grad=False)
        metrics, ref_logp = [], []
        for step in range(STEPS):
            batch = make_batch(pol.vocab_size, seed=step)
            logp, _ = pol.compute_logprobs(batch)
            batch.token_fields["old_logp"] = perturb_old_logp(logp, seed=step + 1)
            add_weights(batch)
            if ref is not None:
                ref_logp.append(ref.compute_logprobs(batch)[0])
            metrics.append(pol.train_step(batch, policy_loss_fn))
            pol.sync_params()  # in both runs, as before a weight update
            if offload is not None:
                t = policy_tensors(pol)
                offload.offload(keep_params=True)
                res.setdefault("params_kept", []).append(min(storage_sizes(t["params"])))
                offload.offload()
                released = {k: storage_sizes(v) for k, v in t.items()}
                if ref is not None:
                    released["reference"] = storage_sizes(list(ref.model_chunks[0].parameters()))
                res.setdefault("released", []).append(released)
                res.setdefault("offload_stats", []).append(offload.storages.host_bytes)
                offload.onload()
                res.setdefault("restored", []).append(min(storage_sizes(t["params"] + t["grads"])))
                res.setdefault("param_in_buffer", []).append(
                    all(p.untyped_storage()._cdata == b.param_data.untyped_storage()._cdata
                        for d in pol.ddps for b in d.buffers + d.expert_parallel_buffers for p in b.params))
        res[run_name] = {"metrics": metrics, "params": hf_tensors(pol, use_grad=False),
                         "optimizer": optimizer_state(pol), "ref_logp": ref_logp}
    if info.rank == 0:
        torch.save(res, out_dir / f"{name}.pt")
    barrier()
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


def main() -> None:
    out_dir = Path(sys.argv[1])
    dirs = {"qwen3": sys.argv[2], "moe": sys.argv[3]}
    for name in sys.argv[4].split(",") if len(sys.argv) > 4 else LAYOUTS:
        run(name, dirs[LAYOUTS[name]["model"]], out_dir)
    destroy_distributed()


if __name__ == "__main__":
    main()
