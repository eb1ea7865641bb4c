"""Worker (torchrun, 2 processes, one GPU each): the package's collectives on the default backend map
(``cpu:gloo,cuda:nccl``) with CPU and CUDA tensors, the stop flag, and a TP=2 training step, reshard and
generation on CUDA. Usage: worker_nccl.py OUT_DIR MODEL_DIR; rank 0 writes OUT_DIR/nccl.json."""

import json
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "policy"))

from common import TEMPERATURE, add_weights, make_batch, perturb_old_logp, policy_loss_fn  # noqa: E402

from mcpo_megatron import accounting  # noqa: E402
from mcpo_megatron.models.optim import OptimSettings  # noqa: E402
from mcpo_megatron.models.policy import MegatronPolicy  # noqa: E402
from mcpo_megatron.models.policy_settings import PolicySettings  # noqa: E402
from mcpo_megatron.parallel.distributed import (  # noqa: E402
    all_gather, all_gather_objects, all_reduce_max, all_reduce_sum, barrier, broadcast, destroy_distributed,
    init_distributed,
)
from mcpo_megatron.rollout.engines.interface import SamplingParams, generate_data_parallel  # noqa: E402
from mcpo_megatron.rollout.weights.resharder import Resharder  # noqa: E402
from mcpo_megatron.rollout.engines.torch.engine import TorchRolloutEngine  # noqa: E402
from mcpo_megatron.trainer.preemption import StopRequest  # noqa: E402


def main() -> None:
    out_dir, model_dir = Path(sys.argv[1]), sys.argv[2]
    info = init_distributed(2, 1, seed=0)
    res = {"backend": dist.get_backend_config(), "device": str(info.device)}
    r = info.rank
    res["cpu_sum"] = all_reduce_sum(torch.tensor([r + 1.0], dtype=torch.float64)).item()        # gloo
    res["cpu_max"] = all_reduce_max(torch.tensor([r], dtype=torch.int64)).item()
    res["cuda_sum"] = all_reduce_sum(torch.tensor([r + 1.0], device=info.device)).item()        # nccl
    res["cuda_broadcast"] = broadcast(torch.tensor([r + 5.0], device=info.device), src=1).item()
    res["cuda_gather"] = [t.item() for t in all_gather(torch.tensor([r * 2.0], device=info.device))]
    res["cpu_gather"] = [t.item() for t in all_gather(torch.tensor([r * 3.0]))]
    res["objects"] = all_gather_objects({"rank": r})
    stop = StopRequest(enabled=True)
    if r == 1:
        stop._handle(signal.SIGUSR1, None)  # one rank signalled
    res["stop_agreed"] = stop.agreed()
    stop.close()
    res["peak_memory_bytes"] = accounting.peak_memory_bytes(all_ranks=True)

    pol = MegatronPolicy(model_dir, PolicySettings(dtype=torch.bfloat16, temperature=TEMPERATURE,
                                                   optim=OptimSettings(lr=1e-3, weight_decay=0.0),
                                                   max_tokens_per_microbatch=64, overlap_grad_reduce=True,
                                                   overlap_param_gather=True), parallel_info=info)
    batch = make_batch(pol.vocab_size)
    logp, _ = pol.compute_logprobs(batch)
    batch.token_fields["old_logp"] = perturb_old_logp(logp)
    add_weights(batch)
    metrics = pol.train_step(batch, policy_loss_fn)
    res["step"] = {k: metrics[k] for k in ("loss", "grad_norm", "skipped")}
    engine = TorchRolloutEngine(pol.hf_config, dtype=torch.bfloat16, device=info.device)
    pol.sync_params()
    stats = Resharder(pol.model_chunks, pol.hf_config, bucket_mb=4, parallel_info=info).push(engine)
    res["reshard_gbps"] = stats.gbps
    out = generate_data_parallel(engine, [[1, 2, 3], [4, 5]], SamplingParams(n=2, max_new_tokens=4, seed=0))
    res["samples"] = len(out)
    if info.rank == 0:
        (out_dir / "nccl.json").write_text(json.dumps(res, indent=2))
    barrier()
    destroy_distributed()


if __name__ == "__main__":
    main()
