"""torchrun worker (4 ranks, gloo): resharding layouts, rollout DP and the numerics contract.

Usage: worker_reshard.py OUT_DIR HF_DIR

For each training layout (TP=2, PP=2, TP=2 x PP=2) it builds the Megatron policy
from HF_DIR, pushes its weights into a CPU engine through a recording wrapper
(bucket sizes, tensors of earlier buckets still alive), generates with rollout DP at several
rollout TP sizes, and recomputes the log-probs with the policy.  Results go to
OUT_DIR/result_rank{r}.pt; the pytest side asserts on them.
"""

from __future__ import annotations

import gc
import sys
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from mcpo_megatron.models.policy import MegatronPolicy
from mcpo_megatron.models.policy_settings import PolicySettings
from mcpo_megatron.parallel.distributed import init_distributed
from mcpo_megatron.rollout.engines.contract import policy_contract_figures
from mcpo_megatron.rollout.engines.interface import SamplingParams, generate_data_parallel
from mcpo_megatron.rollout.weights.resharder import Resharder, tensor_bytes
from mcpo_megatron.rollout.engines.torch.engine import TorchRolloutEngine

BUCKET_MB = 0.02  # ~20 KiB: many buckets even for a tiny model
PROMPTS = [[3, 17, 42], [5, 6, 7, 8, 9, 10], [100], [11, 12], [200, 201, 202, 203], [7, 7]]


class RecordingEngine:
    """Forwards buckets to an engine and records what the resharder handed over."""


    def __init__(self, engine, model_params):
        self.engine = engine
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in model_params}
        self.bucket_sizes: list[tuple[int, int]] = []  # (bytes, tensors)
        self.bucket_names: list[list[str]] = []
        self.max_stale_bytes = 0
        self.transient_stale = 0
        self._refs: list[weakref.ref] = []

    def _stale_bytes(self) -> int:
        stale = 0
        for r in self._refs:
            t = r()
            if t is not None and t.untyped_storage().data_ptr() not in self.param_ptrs:
                stale += tensor_bytes(t)
        return stale

    def update_weights(self, named):
        named = list(named)
        # Reference counting frees tensors at once; gc.collect per bucket would be far too slow.
        # gloo's worker thread may still hold a just-broadcast tensor for a moment: recheck after
        # a pause and a collection before counting it as kept alive.
        stale = self._stale_bytes()
        if stale:
            self.transient_stale += 1
            time.sleep(0.2)
            gc.collect()
            stale = self._stale_bytes()
        self.max_stale_bytes = max(self.max_stale_bytes, stale)
        self.bucket_sizes.append((sum(tensor_bytes(t) for _, t in named), len(named)))
        self.bucket_names.append([n for n, _ in named])
        self._refs = [weakref.ref(t) for _, t in named]
        self.engine.update_weights(named)


def reference_hf_tensors(hf_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def main() -> None:
    out_dir, hf_dir = Path(sys.argv[1]), sys.argv[2]
    from megatron.core import parallel_state as ps

    ref = reference_hf_tensors(hf_dir)
    results: dict = {}
    for tp, pp in [(2, 1), (1, 2), (2, 2)]:
        key = f"tp{tp}pp{pp}"
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        info = init_distributed(tp, pp, seed=0)
        policy = MegatronPolicy(hf_dir, PolicySettings(dtype=torch.float32, temperature=0.7, transformer_impl="local"),
                                parallel_info=info)
        cfg = policy.hf_config
        res: dict = {}

        # Gather plan into the CPU engine, recording buckets.
        engine = TorchRolloutEngine(cfg, dtype=torch.float32)
        rec = RecordingEngine(engine, [p for c in policy.model_chunks for p in c.parameters()])
        stats = Resharder(policy.model_chunks, cfg, bucket_mb=BUCKET_MB, parallel_info=info).push(rec)
        res["stats"] = dict(bytes=stats.bytes, buckets=stats.buckets, max_bucket_bytes=stats.max_bucket_bytes,
                            tensors=stats.tensors)
        res["bucket_sizes"] = rec.bucket_sizes
        res["bucket_names"] = rec.bucket_names
        res["max_stale_bytes"] = rec.max_stale_bytes
        res["transient_stale"] = rec.transient_stale
        engine_sd = engine.model.state_dict()
        res["weight_mismatch"] = sorted(n for n, t in ref.items() if not torch.equal(engine_sd[n], t))
        res["weights_missing_from_ref"] = sorted(n for n in engine.weight_names() if n not in ref
                                                 and not (n == "lm_head.weight" and cfg.tie_word_embeddings))

        # The same against the models package's HF export of this layout.
        try:
            from mcpo_megatron.models.hf_export import export_hf
        except ImportError:
            export_hf = None
        if export_hf is not None:
            exp_dir = out_dir / f"export_{key}"
            export_hf(policy.model_chunks, cfg, str(exp_dir))
            dist.barrier()
            exported = reference_hf_tensors(str(exp_dir))
            res["export_mismatch"] = sorted(n for n, t in exported.items() if not torch.equal(engine_sd[n], t))
            res["export_names"] = len(exported)

        # Rollout DP: 4, 2 and 1 replicas give the same samples.
        sp = SamplingParams(n=3, temperature=0.7, max_new_tokens=8, seed=5)
        dp = {}
        for rtp in (1, 2, 4):
            o = generate_data_parallel(engine, PROMPTS, sp, rollout_tp=rtp)
            dp[rtp] = dict(tokens=o.token_ids, logprobs=o.logprobs, prompt_indices=o.prompt_indices)
        res["dp"] = dp

        # The contract: engine log-probs vs the policy's recomputation.
        o = generate_data_parallel(engine, PROMPTS, SamplingParams(n=2, temperature=0.7, max_new_tokens=12,
                                                                   seed=1), rollout_tp=1)
        res["contract"] = policy_contract_figures(policy, PROMPTS, o)
        results[key] = res
        del policy, engine, rec
        gc.collect()
        dist.barrier()

    torch.save(results, out_dir / f"result_rank{dist.get_rank()}.pt")
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
