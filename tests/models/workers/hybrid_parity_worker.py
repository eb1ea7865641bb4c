"""2-process worker: tiny Qwen3.5 (hybrid Gated DeltaNet) models at TP=2 and PP=2 -> logits and exports.

Usage: hybrid_parity_worker.py ROOT  (ROOT holds one HF dir per family, families.json and ids.pt; see
test_hybrid_parity_mp.py).  Per layout and family: the last stage's gathered logits, and an export of the loaded
model (the HF stream assembled from the shards) for a tensor-by-tensor comparison with the checkpoint.
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
    destroy_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
