"""2-process worker: tiny models with rotary scaling (llama3, yarn) at TP=2 -> logits and exports in ROOT.

Usage: rope_worker.py ROOT  (ROOT holds one HF dir per name in names.json and ids.pt; see test_rope_scaling_mp.py)
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoConfig

from mcpo_megatron.models.builder import build_model_chunks
from mcpo_megatron.models.parity import megatron_logits
from mcpo_megatron.models.hf_export import export_hf
from mcpo_megatron.models.hf_io import load_hf_weights
from mcpo_megatron.parallel.distributed import destroy_distributed, init_distributed


def main(root: Path) -> None:
    names = json.loads((root / "names.json").read_text())
    ids = torch.load(root / "ids.pt")
    info = init_distributed(2, 1, seed=0)
    for name in names:
        cfg = AutoConfig.from_pretrained(root / name)
        chunks = build_model_chunks(cfg, dtype=torch.float32)
        load_hf_weights(chunks, root / name)
        logits = megatron_logits(chunks, ids)
        if info.tp_rank == 0:
            torch.save(logits, root / f"logits_{name}.pt")
        export_hf(chunks, cfg, root / f"export_{name}")
    destroy_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
