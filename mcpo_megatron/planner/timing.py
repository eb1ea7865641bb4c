"""Time figures of a step from model FLOPs: the preemption lead, and how many ranks should generate with separate
placement.

The preemption lead time (``trainer/preemption.py``): a signal that arrives just after generation waits for the
old log-prob pass, the updates and a checkpoint. Worst case, every response at its maximum length: model FLOPs
(``accounting.model_flops``: a forward for the old log-probs, ``ppo_epochs`` x 3 forwards for the updates) over
``world x peak x MFU`` (``--peak-tflops``, ``--mfu``), plus the checkpoint's bytes (bf16 weights, fp32 master
weights and Adam moments: 14 bytes per parameter) at the file system's aggregate write bandwidth
(``--fs-write-gbps``). With separate placement the checkpoint also waits for the next step's batch, which the
engines generate while the step trains (``trainer/held_batches.py``): the lead covers the longer of the two
(generation at ``DEFAULT_GEN_MFU`` on the engine ranks). These are first-order figures; the trainer logs the
measured worst case of each step as ``time/preempt_lead_needed``.

With ``rollout.placement=separate``, :func:`suggest_split` divides a launch between engine and training ranks from
the step's generation and training work, measured (device-seconds of an earlier run) or estimated (model FLOPs at
an assumed MFU per phase, :func:`step_work`: decoding reaches a lower one than training).
"""

from __future__ import annotations

import math
from typing import Any

from mcpo_megatron.planner.common import cfg_get
from mcpo_megatron.planner.counts import param_counts

H100_PEAK_TFLOPS = 989.0         # dense bf16, one H100 SXM (accounting.H100_BF16_DENSE_PEAK)
DEFAULT_MFU = 0.35               # model FLOPs utilisation assumed for the step-time estimate
DEFAULT_GEN_MFU = 0.15           # ... for generation: decoding is bound by memory bandwidth, batches thin out
DEFAULT_FS_WRITE_GBPS = 5.0      # aggregate checkpoint write bandwidth assumed (GB/s)
CHECKPOINT_BYTES_PER_PARAM = 14  # bf16 weights + fp32 master weights + Adam m and v


def estimate_preempt_lead(shape: Any, cfg: Any, world: int, *, peak_flops: float,
                          mfu: float = DEFAULT_MFU, fs_write_gbps: float = DEFAULT_FS_WRITE_GBPS,
                          engine_world: int = 0, gen_mfu: float = DEFAULT_GEN_MFU) -> dict[str, float]:
    """Seconds a preemption signal needs, worst case, to finish the step after generation and checkpoint
    (module docstring). ``engine_world``: the engine ranks of separate placement (0: colocated). Keys:
    train_flops, train_s, checkpoint_bytes, checkpoint_s, lead_s, suggested_lead_s; with engine ranks also
    generate_flops and generate_s."""
    from mcpo_megatron import accounting

    if not (peak_flops > 0 and 0 < mfu <= 1 and fs_write_gbps > 0):
        raise ValueError(f"peak_flops={peak_flops}, mfu={mfu}, fs_write_gbps={fs_write_gbps}: need peak > 0, "
                         "0 < mfu <= 1 and a bandwidth > 0")
    sequences = int(cfg_get(cfg, "data.train_batch_size")) * int(cfg_get(cfg, "rollout.n"))
    prompt, response = int(cfg_get(cfg, "data.max_prompt_length")), int(cfg_get(cfg, "data.max_response_length"))
    epochs = int(cfg_get(cfg, "algorithm.ppo_epochs", 1))
    lengths = dict(prompt_lens=prompt, response_lens=response, num_sequences=sequences)
    flops = (accounting.model_flops(shape, kind="logprob", **lengths)
             + epochs * accounting.model_flops(shape, kind="train", **lengths))
    train_s = flops / (world * peak_flops * mfu)
    ckpt_bytes = param_counts(shape, 1, 1)["total"] * CHECKPOINT_BYTES_PER_PARAM
    ckpt_s = ckpt_bytes / (fs_write_gbps * 1e9)
    out = dict(train_flops=flops, train_s=train_s, checkpoint_bytes=ckpt_bytes, checkpoint_s=ckpt_s)
    lead = train_s + ckpt_s
    if engine_world > 0:  # the next batch, generated while the step trains, is waited for before the checkpoint
        out["generate_flops"] = accounting.model_flops(shape, kind="generate", **lengths)
        out["generate_s"] = out["generate_flops"] / (engine_world * peak_flops * gen_mfu)
        out.update(engine_world=engine_world, generate_mfu=gen_mfu)
        lead = max(train_s, out["generate_s"]) + ckpt_s
    return dict(out, lead_s=lead, suggested_lead_s=math.ceil((1.25 * lead + 60) / 60) * 60)


def step_work(shape: Any, cfg: Any) -> dict[str, float]:
    """Model FLOPs of one global step at full length: generation (every sequence) and training (the old-log-prob
    pass, ``ppo_epochs`` updates, and the reference pass with ``algorithm.kl``)."""
    from mcpo_megatron import accounting

    lengths = dict(prompt_lens=int(cfg_get(cfg, "data.max_prompt_length")),
                   response_lens=int(cfg_get(cfg, "data.max_response_length")),
                   num_sequences=int(cfg_get(cfg, "data.train_batch_size")) * int(cfg_get(cfg, "rollout.n")))
    passes = 2 if cfg_get(cfg, "algorithm.kl.enable", False) else 1
    train = (passes * accounting.model_flops(shape, kind="logprob", **lengths)
             + int(cfg_get(cfg, "algorithm.ppo_epochs", 1)) * accounting.model_flops(shape, kind="train", **lengths))
    return dict(generate_flops=accounting.model_flops(shape, kind="generate", **lengths), train_flops=train)


def suggest_split(cfg: Any, world: int, *, gen_device_s: float, train_device_s: float,
                  gpus_per_node: int | None = None) -> list[dict[str, Any]]:
    """Every valid division of ``world`` ranks into engine and training ranks, fastest first.

    ``gen_device_s`` / ``train_device_s``: device-seconds of one step's generation and training (measured: the
    phase's seconds times the ranks it ran on; or estimated from FLOPs). Both are taken to scale linearly with
    ranks, so with R engine ranks generation takes ``gen_device_s / R`` and training ``train_device_s / (world -
    R)``. A valid split passes ``validate`` (R a multiple of the rollout TP, the rest a multiple of TP x PP and of
    the mini-batch's DP rule). Per split: ranks, nodes (when whole), the phase times, and the step time with
    generation overlapping training (``trainer.max_staleness >= 1``: the longer phase) and without (0: their sum).
    """
    from omegaconf import OmegaConf

    from mcpo_megatron import config as C

    rows = []
    for ranks in range(1, world):
        trial = OmegaConf.merge(C.as_dictconfig(cfg), {"rollout": {"placement": "separate", "ranks": ranks}})
        try:
            C.validate(trial, world)
        except C.ConfigError:
            continue
        gen_s, train_s = gen_device_s / ranks, train_device_s / (world - ranks)
        whole = gpus_per_node and ranks % gpus_per_node == 0
        rows.append(dict(ranks=ranks, nodes=ranks // gpus_per_node if whole else None, generate_s=gen_s,
                         train_s=train_s, overlapped_s=max(gen_s, train_s), sequential_s=gen_s + train_s))
    return sorted(rows, key=lambda r: (r["overlapped_s"], r["ranks"]))
