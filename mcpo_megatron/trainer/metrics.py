"""What a step shows: its record (:func:`step_metrics` and the builders after it, from the step's
:class:`~mcpo_megatron.trainer.step_data.StepOutcome`), written as one JSONL record, TensorBoard scalars, optional
W&B, and a tqdm bar (rank 0 only)."""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

from mcpo_megatron import accounting
from mcpo_megatron.accounting import parse_jsonl, read_jsonl  # noqa: F401  read_jsonl: the reader beside truncate_jsonl
from mcpo_megatron.algorithms import kl, losses, mastery
from mcpo_megatron.parallel.distributed import ParallelInfo, all_reduce_max, all_reduce_sum
from mcpo_megatron.rewards import types as reward_types
from mcpo_megatron.rollout.episodes import episode_metrics
from mcpo_megatron.trainer import step_data
from mcpo_megatron.trainer.step_data import StepOutcome

if TYPE_CHECKING:
    from mcpo_megatron.config import Config
    from mcpo_megatron.rollout.placement import RolloutPlacement
    from mcpo_megatron.trainer.setup import TrainingSetup

# Fields that measure the machine (wall time, throughput, memory, transfer speed): they legitimately differ
# between two runs of the same job, so resume-equality checks ignore them.
MEASUREMENT_PREFIXES = ("time/", "perf/", "memory/", "reshard/")


def is_measurement_key(key: str) -> bool:
    return key.startswith(MEASUREMENT_PREFIXES)


class StepTimer:
    """Accumulates seconds per phase: ``with timer("rollout"): ...``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0

    def as_metrics(self) -> dict[str, float]:
        out = {f"time/{k}": round(v, 4) for k, v in self.seconds.items()}
        out["time/step"] = round(sum(self.seconds.values()), 4)
        return out


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


class MetricsLogger:
    """Rank 0 writes; other ranks get a logger whose methods do nothing. ``outputs``: the ``logging`` section of
    the config (``jsonl``, ``tensorboard``, ``wandb``); ``config_dict`` goes to W&B."""

    def __init__(self, output_dir: str | Path, outputs: Any, *, enabled: bool, total_steps: int = 0,
                 initial_step: int = 0, config_dict: dict | None = None):
        jsonl, tensorboard, wandb_cfg = outputs.jsonl, outputs.tensorboard, outputs.wandb
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        self._wandb = None
        self._bar = None
        if not enabled:
            return
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        if jsonl:
            self._jsonl = open(out / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(out / "tensorboard"))
        if wandb_cfg is not None and getattr(wandb_cfg, "enable", False):
            import wandb  # optional dependency, imported only when configured

            self._wandb = wandb.init(project=wandb_cfg.project, name=wandb_cfg.name,
                                     entity=getattr(wandb_cfg, "entity", None), config=config_dict, resume="allow")
        from tqdm import tqdm

        self._bar = tqdm(total=total_steps, initial=initial_step, desc="train", unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _jsonable(v) for k, v in sorted(metrics.items())}}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)
            hist = metrics.get("mastery/query_weight_values")
            if hist:
                import numpy as np

                self._tb.add_histogram("mastery/query_weight", np.asarray(hist), step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=step)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix({"reward": f"{record.get('reward/mean', float('nan')):.3f}",
                                   "acc": f"{record.get('acc/mean', float('nan')):.3f}"}, refresh=False)
            self._bar.write(summary_line(record))

    def write(self, message: str) -> None:
        if self.enabled:
            if self._bar is not None:
                self._bar.write(message)
            else:
                print(message, flush=True)

    def close(self) -> None:
        """Close every output (idempotent)."""
        if self._bar is not None:
            self._bar.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._bar = self._jsonl = self._tb = self._wandb = None


SUMMARY_FIELDS = (
    ("reward/mean", "reward", "{:+.3f}"),
    ("acc/mean", "acc", "{:.3f}"),
    ("mastery/mastered_frac", "mastered", "{:.2f}"),
    ("mastery/all_wrong_frac", "all_wrong", "{:.2f}"),
    ("retention/acc", "retention", "{:.2f}"),
    ("hkl/active_frac", "hkl_active", "{:.3f}"),
    ("actor/grad_norm", "gnorm", "{:.3f}"),
    ("actor/entropy", "entropy", "{:.3f}"),
    ("response/length_mean", "len", "{:.1f}"),
    ("mismatch/k3", "k3", "{:.2e}"),
    ("moe/max_expert_load", "max_load", "{:.2f}"),
    ("perf/tokens_per_s_per_gpu", "tok/s/gpu", "{:.0f}"),
    ("time/step", "s", "{:.1f}"),
)


def summary_line(record: dict[str, Any]) -> str:
    """The one-line metrics summary printed per step."""
    parts = [f"step {record['step']}"]
    for key, label, fmt in SUMMARY_FIELDS:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            parts.append(f"{label}={fmt.format(value)}")
    return " | ".join(parts)


def truncate_jsonl(path: str | Path, last_step: int) -> None:
    """Drop records after ``last_step`` (a resumed run re-logs the steps its checkpoint did not hold), and a torn
    last record (see :func:`mcpo_megatron.accounting.read_jsonl`)."""
    path = Path(path)
    if not path.is_file():
        return
    keep = [line for line, record in parse_jsonl(path) if record["step"] <= last_step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    tmp.replace(path)


# ---------------------------------------------------------------------------------------------------- the record
def step_metrics(o: StepOutcome, tracker: mastery.MasteryTracker, cfg: Config, inert: bool) -> dict:
    """The per-step record: rewards, accuracy, advantages, mastery, lengths, the updates' losses, retention (the
    ``tracker`` before it takes this step's groups)."""
    r, rewards, advantages, stats = o.rollouts, o.rewards, o.advantages, o.stats
    lengths = r.response_lengths().double()
    truncated = r.truncated()
    m = {
        "reward/mean": float(rewards.mean()),
        "reward/score_mean": float(r.scores.double().mean()),
        "acc/mean": float(r.correct.double().mean()),
        "adv/mean": float(advantages.mean()),
        "adv/max_abs": float(advantages.abs().max()),
        "mastery/mastered_frac": float(stats.mastered.double().mean()),
        "mastery/majority_frac": float(stats.majority_correct.double().mean()),
        "mastery/all_wrong_frac": float(stats.all_wrong.double().mean()),
        "mastery/query_weight_values": [round(float(w), 6) for w in mastery.query_weight(
            stats.p, r.group_size, estimator=step_data.estimator_name(cfg), std_mode=cfg.algorithm.std_mode,
            threshold=cfg.algorithm.mcpo.threshold).tolist()],
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/truncated_frac": float(truncated.double().mean()),
        "batch/groups": r.num_groups,
        "batch/sequences": r.num_samples,
        "batch/gen_batches": o.generation.num_batches,
        "hkl/inert": 1 if inert else 0,
        "reshard/seconds": o.reshard.seconds,
        "reshard/gbps": o.reshard.gbps,
        **o.mismatch,
    }
    for status, count in reward_types.count_statuses(r.statuses).items():
        m[f"reward/status_{status}"] = count
    for k, v in o.generation.filter_counts.items():
        m[f"filter/{k}"] = v
    if r.gcpo_injected.numel():
        m["gcpo/injected"] = int(r.gcpo_injected.sum())
    if r.model_masks is not None:  # episodes with tool outputs: the model's own tokens
        m["response/model_length_mean"] = float(r.model_token_lengths().double().mean())
    m.update(episode_metrics([x for b in o.generation.batches for x in getattr(b.output, "samples", ())]))
    m.update(update_metrics(o.updates))
    m.update(retention_metrics(o.generation, tracker))
    return m


def update_metrics(u: step_data.PolicyUpdates) -> dict:
    """The optimizer steps' account: grad norm, learning rate, expert load (means over the steps), the loss
    metrics (losses.finalize_metrics)."""
    steps = max(len(u.grad_norms), 1)
    m = {"actor/grad_norm": sum(u.grad_norms) / steps, "actor/lr": u.lr_sum / steps,
         "actor/skipped_steps": u.skipped, "actor/microbatches": u.microbatches,
         # passes run only so that expert-parallel peers meet in every all-to-all (models.passes)
         "actor/filler_microbatches": u.filler_microbatches}
    loss_sums = dict(u.sums)
    for key in [k for k in loss_sums if k.startswith("moe/")]:  # expert load: mean over optimizer steps
        m[key] = loss_sums.pop(key) / steps
    m.update(losses.finalize_metrics(loss_sums))
    return m


def retention_metrics(g: step_data.Generation, tracker: mastery.MasteryTracker) -> dict:
    """Retention (paper Fig. 7): accuracy under the current policy of prompts mastered when last seen, from the
    prompts that recur in this step's generation and, with diagnostics.retention_probe, from extra probe
    rollouts."""
    m = {}
    m["retention/acc"], m["retention/prompts"] = tracker.retention(g.seen.uids, g.seen_stats.p)
    if g.retention_probe is not None:
        probe = g.retention_probe
        m["retention/probe_acc"] = sum(probe) / len(probe) if probe else float("nan")
        m["retention/probe_samples"] = len(probe)
    return m


def rollout_mismatch(plan: step_data.StepPlan, r: step_data.Rollouts, info: ParallelInfo) -> dict[str, float]:
    """Engine vs trainer log-probs on the sampled tokens: mean k3 KL(engine || trainer) and max |diff|.
    Collective: a sum over the data-parallel group and a max over the world."""
    k3_sum, n, max_abs = 0.0, 0, 0.0
    for mb, local in zip(plan.minibatches, plan.local_samples):
        for j, sample in enumerate(local):
            old, roll = mb.token_fields["old_logp"][j], mb.token_fields["rollout_logp"][j]
            keep = step_data.model_tokens(mb, j)
            if keep is not None:  # an episode's tool outputs were not sampled
                old, roll = old[keep], roll[keep]
            if old.numel() == 0 or bool(r.gcpo_injected[sample]):  # a reference answer was not sampled
                continue
            log_ratio = (old.double() - roll.double())  # log p_trainer / p_engine, samples from the engine
            k3_sum += float(kl.k3(log_ratio).sum())
            max_abs = max(max_abs, float(log_ratio.abs().max()))
            n += old.numel()
    # CPU scalars (gloo with the default backend map).
    sums = all_reduce_sum(torch.tensor([k3_sum, float(n)], dtype=torch.float64), info.dp_group)
    mx = all_reduce_max(torch.tensor([max_abs], dtype=torch.float64))
    return {"mismatch/k3": float(sums[0] / max(sums[1], 1.0)), "mismatch/max_abs_logp_diff": float(mx[0])}


def off_policy_metrics(plan: step_data.StepPlan, r: step_data.Rollouts, info: ParallelInfo,
                       ratio: str = "geometric") -> dict[str, float]:
    """The behaviour ratio pi_old / pi_engine of the step's sampled tokens (docs/algorithms.md §8): its mean, min
    and max per token and per response (``ratio``: the sequence statistic of algorithm.sequence_mask), and the
    fractions the token and sequence masks took out. Collective: sums over the data-parallel group, extremes over
    the world."""
    from mcpo_megatron.algorithms.off_policy import RatioStats

    st = RatioStats()
    for mb, local in zip(plan.minibatches, plan.local_samples):
        f = mb.token_fields
        masks = f.get("behaviour_mask")
        for j, sample in enumerate(local):
            if bool(r.gcpo_injected[sample]):  # a reference answer was not sampled
                continue
            old, roll, mask = f["old_logp"][j], f["rollout_logp"][j], None if masks is None else masks[j]
            keep = step_data.model_tokens(mb, j)
            if keep is not None:  # nor were an episode's tool outputs
                old, roll, mask = old[keep], roll[keep], None if mask is None else mask[keep]
            st.add(old, roll, mask, ratio)
    sums = all_reduce_sum(torch.tensor([st.tokens, st.ratio_sum, st.sequences, st.seq_ratio_sum, st.masked_tokens,
                                        st.masked_sequences], dtype=torch.float64), info.dp_group)
    ext = all_reduce_max(torch.tensor([-st.ratio_min, st.ratio_max, -st.seq_ratio_min, st.seq_ratio_max],
                                      dtype=torch.float64))
    total = RatioStats(int(sums[0]), float(sums[1]), -float(ext[0]), float(ext[1]), int(sums[2]), float(sums[3]),
                       -float(ext[2]), float(ext[3]), int(sums[4]), int(sums[5]))
    return total.metrics()


def async_metrics(o: StepOutcome, step: int, rollouts: RolloutPlacement) -> dict:
    """The account of a step (docs/algorithms.md section 13; 0-based ``step``): how old the trained samples'
    policy was, what was dropped for staleness, and the placement's own account of its engines
    (``generation_metrics``: with engines on ranks of their own, where their time went and how the weights
    travelled)."""
    r, g = o.rollouts, o.generation
    staleness = (step - r.versions).double()
    m = {"async/staleness_mean": float(staleness.mean()), "async/staleness_max": float(staleness.max()),
         "async/policy_version_min": int(r.versions.min()),
         "async/stale_dropped_frac": g.stale_samples / max(g.seen.num_samples, 1)}
    m.update(rollouts.generation_metrics(g.batches))
    if r.token_versions is not None:
        m.update(partial_metrics(r.token_versions, step, [b.partial for b in g.batches]))
    return m


LAG_BUCKETS = (0, 1, 2)  # partial/token_lag_{0,1,2}_frac, then partial/token_lag_3plus_frac


def partial_metrics(token_versions: list[list[int]], step: int, batches: list[dict]) -> dict:
    """Partial rollouts (docs/algorithms.md §13) at 0-based ``step``: the share of trained tokens per lag (step -
    the version that sampled it), the policy versions each trained response spans, and what the step's generation
    batches did to the pool (segments run, records dropped for staleness and their tokens, due and new groups; the
    groups and unfinished records left in the pool after the last batch)."""
    lags = torch.tensor([step - v for seq in token_versions for v in seq], dtype=torch.long)
    spans = torch.tensor([max(seq) - min(seq) + 1 for seq in token_versions if seq], dtype=torch.float64)
    tokens = max(lags.numel(), 1)
    m = {f"partial/token_lag_{k}_frac": int((lags == k).sum()) / tokens for k in LAG_BUCKETS}
    m[f"partial/token_lag_{LAG_BUCKETS[-1] + 1}plus_frac"] = int((lags > LAG_BUCKETS[-1]).sum()) / tokens
    m["partial/token_lag_mean"] = float(lags.double().mean()) if lags.numel() else 0.0
    m["partial/versions_spanned_mean"] = float(spans.mean()) if spans.numel() else 0.0
    m["partial/versions_spanned_max"] = int(spans.max()) if spans.numel() else 0
    for key in ("segments", "dropped_sequences", "dropped_tokens", "due_groups", "new_groups"):
        m[f"partial/{key}"] = sum(int(b.get(key, 0)) for b in batches)
    if batches:
        m["partial/carried_groups"] = int(batches[-1].get("pool_groups", 0))
        m["partial/carried_unfinished"] = int(batches[-1].get("pool_unfinished", 0))
    return m


def offload_metrics(rollouts: RolloutPlacement) -> dict:
    """``trainer.offload``'s account of the step: what left the GPU while the engine generated (copied to host
    memory; gradients released without a copy) and the seconds and GB/s of the offload and of the onload before
    the step's training. Empty when the state stays on the GPU."""
    off = getattr(rollouts, "offload", None)
    if off is None:
        return {}
    out, back = off.last_offload, off.last_onload
    return {"memory/offload_copied_gb": out.copied_bytes / 1e9, "memory/offload_released_gb": out.released_bytes / 1e9,
            "time/offload": out.seconds, "time/onload": back.seconds,
            "perf/offload_gbps": out.gbps, "perf/onload_gbps": back.gbps}


def throughput_metrics(s: TrainingSetup, o: StepOutcome, record: dict, shape) -> dict:
    """Tokens, FLOPs, MFU and peak memory of the step (accounting.step_accounting; reads the step's timings in
    ``record``): training on the trainer's ranks, generation on the engines' own ranks when they have some."""
    prompt_lens, response_lens = accounting.iter_lengths(o.rollouts.prompt_ids, o.rollouts.response_ids,
                                                         o.rollouts.group_size)
    seen = o.generation.seen  # every generated sequence, also those dynamic sampling or staleness dropped
    gen_prompt_lens, gen_response_lens = accounting.iter_lengths(seen.prompt_ids, seen.response_ids, seen.group_size)
    engines, world = s.rollouts.engine_ranks, s.info.world_size
    work = accounting.StepWork(prompt_lens, response_lens, gen_prompt_lens=gen_prompt_lens,
                               gen_response_lens=gen_response_lens, ppo_epochs=s.cfg.algorithm.ppo_epochs,
                               logprob_passes=2 if s.ref_policy is not None else 1)
    devices = accounting.StepDevices(world + engines, train_world_size=world,
                                     rollout_world_size=engines or None,  # None: generation shares the devices
                                     generation_time_key=s.rollouts.generation_time_key)
    return accounting.step_accounting(shape, record, work, devices,
                                      peak_bytes=accounting.peak_memory_bytes(all_ranks=True))
