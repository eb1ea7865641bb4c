"""bf16 parity on one GPU: MegatronPolicy's log-probs and one training step against transformers float64.

The checks of tests/policy/test_policy_bf16.py (tiny random Qwen3, bf16 weights with fp32 master weights and
Adam state, temperature 0.7, the MCPO loss with clipping and the hinge active) at TP = ``--nproc`` processes:
one on a single GPU (NCCL refuses two ranks on one device), two on two GPUs or on CPU. The figures go to
``--json``; the exit status is 1 when one of the test's limits is broken::

    python3 gpu_kit/parity.py --json parity.json            # one process: the GPU when there is one
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help="where to write the figures")
    ap.add_argument("--nproc", type=int, default=1, help="processes = tensor-parallel size (default 1)")
    args = ap.parse_args(argv)
    sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "policy")]
    from test_policy_bf16 import failures, logprob_figures, run_bf16_worker, step_figures

    with tempfile.TemporaryDirectory(prefix="mcpo-gpu-kit-parity-") as work:
        res, hf = run_bf16_worker(Path(work), nproc=args.nproc)
    figures = {"tp": res["tp"], "device": res["device"], **logprob_figures(res, hf), **step_figures(res, hf)}
    figures["failures"] = failures(figures)
    Path(args.json).write_text(json.dumps(figures, indent=2))
    print(json.dumps(figures))
    return 1 if figures["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
