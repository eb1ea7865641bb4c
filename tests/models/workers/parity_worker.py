"""4-process worker: tiny HF models at TP=2, PP=2 and TP=2 x PP=2 -> logits and exports in a results dir.

The qwen3 model is also built in bf16 at PP=2 and TP=2 x PP=2 (the local layer spec, as on a GPU without
Transformer Engine): its parameter dtypes, logits, weight stream and export.

Usage: parity_worker.py ROOT  (ROOT holds one HF dir per family and ids.pt; see test_parity_mp.py)
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoConfig

from mcpo_megatron.models.builder import build_gpt_model
from mcpo_megatron.models.parity import megatron_logits
from mcpo_megatron.models.hf_export import export_hf
from mcpo_megatron.models.hf_io import iter_hf_tensors, load_hf_weights
from mcpo_megatron.parallel.distributed import destroy_distributed, init_distributed

LAYOUTS = [(2, 1), (1, 2), (2, 2)]
BF16_LAYOUTS = [(1, 2), (2, 2)]


def main(root: Path) -> None:
    families = json.loads((root / "families.json").read_text())
    ids = torch.load(root / "ids.pt")
    from megatron.core import parallel_state as ps

    for tp, pp in LAYOUTS:
        info = init_distributed(tp, pp, seed=0)
        for fam in families:
            hf_dir = root / fam
            cfg = AutoConfig.from_pretrained(hf_dir)
            model = build_gpt_model(cfg, dtype=torch.float32)
            load_hf_weights(model, hf_dir)
            logits = megatron_logits(model, ids)
            tag = f"{fam}_{tp}x{pp}"
            if info.is_last_stage and info.tp_rank == 0 and info.dp_rank == 0:
                torch.save(logits, root / f"logits_{tag}.pt")
            # every rank sees the same stream of names and values
            stream = [(n, float(t.double().sum())) for n, t in iter_hf_tensors(model, cfg)]
            (root / f"stream_{tag}_rank{info.rank}.json").write_text(json.dumps(stream))
            export_hf(model, cfg, root / f"export_{tag}", tokenizer_dir=hf_dir)
            if (tp, pp) == (2, 2) and fam == "qwen3":
                # several shards + index; load them back into a fresh model
                sharded = root / f"export_sharded_{tag}"
                export_hf(model, cfg, sharded, max_shard_bytes=64 * 1024)
                again = build_gpt_model(cfg, dtype=torch.float32)
                load_hf_weights(again, sharded)
                logits2 = megatron_logits(again, ids)
                if logits2 is not None and info.tp_rank == 0 and info.dp_rank == 0:
                    torch.save(logits2, root / f"logits_sharded_{tag}.pt")
            del model
        if (tp, pp) in BF16_LAYOUTS:
            bf16_case(root, info, ids, f"{tp}x{pp}")
        ps.destroy_model_parallel()
    destroy_distributed()


def bf16_case(root: Path, info, ids: torch.Tensor, layout: str) -> None:
    """qwen3 in bf16: every parameter's dtype (per rank), logits, the weight stream and an export."""
    hf_dir = root / "qwen3"
    cfg = AutoConfig.from_pretrained(hf_dir)
    model = build_gpt_model(cfg, dtype=torch.bfloat16)
    load_hf_weights(model, hf_dir)
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    (root / f"bf16_dtypes_{layout}_rank{info.rank}.json").write_text(json.dumps(dtypes))
    logits = megatron_logits(model, ids)
    if info.is_last_stage and info.tp_rank == 0 and info.dp_rank == 0:
        torch.save(logits, root / f"logits_bf16_{layout}.pt")
    stream = [(n, str(t.dtype), float(t.double().sum())) for n, t in iter_hf_tensors(model, cfg)]
    (root / f"stream_bf16_{layout}_rank{info.rank}.json").write_text(json.dumps(stream))
    export_hf(model, cfg, root / f"export_bf16_{layout}", tokenizer_dir=hf_dir)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
