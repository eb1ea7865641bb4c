"""Worker (run under torchrun, TP = world size): vocab_parallel_logprobs on this rank's shard.

Usage: worker_logprobs_tp.py OUT_DIR.  Every rank builds the same full logits,
keeps its contiguous vocabulary slice, and saves OUT_DIR/rank{R}.pt with the
log-probs, entropy and the gradient of sum(w1*logp + w2*entropy) w.r.t. its
shard, for each case in CASES.
"""

import os
import sys
from pathlib import Path

import torch

from mcpo_megatron.parallel.distributed import destroy_distributed, init_distributed
from mcpo_megatron.parallel.logprobs import vocab_parallel_logprobs

# (name, leading shape, vocab, temperature, chunk_size, compute_entropy, inplace_backward)
CASES = [
    ("base", (5, 7), 64, 1.0, 4, True, False),
    ("temp", (3, 11), 128, 0.7, 5, True, False),
    ("one_chunk", (9,), 32, 1.3, 4096, True, True),
    ("no_entropy", (2, 6), 48, 1.0, 5, False, False),
]


def case_inputs(shape, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, vocab, generator=g) * 4
    targets = torch.randint(0, vocab, shape, generator=g)
    w_lp = torch.randn(*shape, generator=g)
    w_h = torch.randn(*shape, generator=g)
    return logits, targets, w_lp, w_h


def main() -> None:
    out_dir = Path(sys.argv[1])
    info = init_distributed(tp=int(os.environ["WORLD_SIZE"]), pp=1)
    results = {}
    for i, (name, shape, vocab, temp, chunk, ent, inplace) in enumerate(CASES):
        logits, targets, w_lp, w_h = case_inputs(shape, vocab, seed=100 + i)
        vp = vocab // info.tp
        leaf = logits[..., info.tp_rank * vp:(info.tp_rank + 1) * vp].clone().requires_grad_(True)
        shard = leaf * 1.0  # a non-leaf, as produced by the output layer
        logp, entropy = vocab_parallel_logprobs(
            shard, targets, info.tp_group, chunk_size=chunk, temperature=temp,
            compute_entropy=ent, inplace_backward=inplace,
        )
        loss = (w_lp * logp).sum() + ((w_h * entropy).sum() if ent else 0.0)
        loss.backward()
        results[name] = {"logp": logp.detach(), "entropy": None if entropy is None else
                         entropy.detach(), "grad": leaf.grad, "vp": vp}
    torch.save({"tp": info.tp, "tp_rank": info.tp_rank, "results": results},
               out_dir / f"rank{info.rank}.pt")
    destroy_distributed()


if __name__ == "__main__":
    main()
