"""The engine process of ``mcpo selftest``'s ``batch_invariance`` check (``commands/selftest_checks.py``): a
standalone vLLM engine on one GPU with vLLM's batch-invariant mode on (``rollout.batch_invariant``), which
generates the check's probe prompts alone and among others and writes the figures as JSON.

The check starts it as ``python -c`` calling :func:`main` with ``MODEL_DIR OUT_JSON`` (only the CLI runs as a
script), with the rank's GPU alone visible and no launcher variables."""

from __future__ import annotations

import json
from pathlib import Path

from mcpo_megatron.commands.selftest_checks import INVARIANCE_OTHERS, INVARIANCE_PROBES, batch_composition_figures
from mcpo_megatron.rollout.engines.interface import SamplingParams

SAMPLING = SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=0)
GPU_SHARE = 0.3  # of the rank's GPU, beside the selftest process's own use of it


def main(argv: list[str]) -> int:
    model_dir, out = argv
    from mcpo_megatron.rollout.engines.vllm.engine import VLLMRolloutEngine

    longest = max(len(p) for p in INVARIANCE_PROBES + INVARIANCE_OTHERS) + SAMPLING.max_new_tokens
    engine = VLLMRolloutEngine(model_dir, standalone=True, batch_invariant=True, dtype="bfloat16",
                               max_model_len=longest, max_num_seqs=32, gpu_memory_utilization=GPU_SHARE,
                               enable_sleep_mode=False)
    try:
        figures = batch_composition_figures(engine, INVARIANCE_PROBES, INVARIANCE_OTHERS, SAMPLING)
    finally:
        engine.close()
    Path(out).write_text(json.dumps(figures))
    return 0
