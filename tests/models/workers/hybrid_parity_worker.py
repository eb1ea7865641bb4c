"""2-process worker: tiny Qwen3.5 (hybrid Gated DeltaNet) models at TP=2 and PP=2 -> logits and exports; and the
MCPO loss's gradients of the first family through MegatronPolicy at TP=2.

Usage: hybrid_parity_worker.py ROOT  (ROOT holds one HF dir per family, families.json and ids.pt; see
test_hybrid_parity_mp.py).  Per layout and family: the last stage's gathered logits, and an export of the loaded
model (the HF stream assembled from the shards) for a tensor-by-tensor comparison with the checkpoint.  Then the
policy's log-probs of the policy tests' probe batch (tests/policy/common.py), perturbed into old_logp, and one
forward-backward of the MCPO loss, and the same for a batch of long sequences (several GDN chunks, padded):
ROOT/grads.pt holds each one's loss, batch (old_logp included) and HF-named gradients.
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoConfig

from mcpo_megatron.models.builder import build_gpt_model
from mcpo_megatron.models.hf_export import export_hf
from mcpo_megatron.models.hf_io import load_hf_weights
from mcpo_megatron.models.parity import megatron_logits
from mcpo_megatron.parallel.distributed import destroy_distributed, init_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "policy"))  # the policy tests' common.py

LAYOUTS = [(2, 1), (1, 2)]


def main(root: Path) -> None:
    from megatron.core import parallel_state as ps

    families = json.loads((root / "families.json").read_text())
    ids = torch.load(root / "ids.pt")
    for tp, pp in LAYOUTS:
        info = init_distributed(tp, pp, seed=0)
        for fam in families:
            cfg = AutoConfig.from_pretrained(root / fam)
            model = build_gpt_model(cfg, dtype=torch.float32)
            load_hf_weights(model, root / fam)
            logits = megatron_logits(model, ids)
            tag = f"{fam}_{tp}x{pp}"
            if info.is_last_stage and info.tp_rank == 0 and info.dp_rank == 0:
                torch.save(logits, root / f"logits_{tag}.pt")
            export_hf(model, cfg, root / f"export_{tag}")
            del model
        ps.destroy_model_parallel()
    gradients(root, families[0])
    destroy_distributed()


def gradients(root: Path, family: str) -> None:
    from common import TEMPERATURE, add_weights, hf_tensors, make_batch, perturb_old_logp, policy_loss_fn

    from mcpo_megatron.models.optim import OptimSettings
    from mcpo_megatron.models.policy import MegatronPolicy
    from mcpo_megatron.models.policy_settings import PolicySettings

    info = init_distributed(2, 1, seed=0)
    pol = MegatronPolicy(str(root / family), PolicySettings(optim=OptimSettings(lr=1e-3, clip_grad=0.0),
                                                            max_tokens_per_microbatch=10_000, logprob_chunk_size=5,
                                                            temperature=TEMPERATURE), parallel_info=info)
    # "long": sequences of 51 to 152 tokens padded into one micro-batch, across the GDN's 64-token chunks as
    # rollouts on real prompts are
    long = make_batch(pol.vocab_size, seed=2, prompt_lens=[50, 62, 41, 70], response_lens=[30, 90, 10, 60],
                      mastered=[True, False, False, True])
    out = {}
    for name, batch in (("probe", make_batch(pol.vocab_size)), ("long", long)):
        logp, _ = pol.compute_logprobs(batch)
        batch.token_fields["old_logp"] = perturb_old_logp(logp)
        add_weights(batch)
        metrics = pol.forward_backward(batch, policy_loss_fn)
        out[name] = {"loss": metrics["loss"], "batch": batch, "grads": hf_tensors(pol, use_grad=True)}
    if info.rank == 0:
        torch.save(out, root / "grads.pt")
    del pol


if __name__ == "__main__":
    main(Path(sys.argv[1]))
