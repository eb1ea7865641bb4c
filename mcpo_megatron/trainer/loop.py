"""The training loop: MCPO (and GRPO / DAPO / Dr.GRPO / GSPO / GCPO) end to end, one global step at a time.

Read top to bottom. Every rank runs this same function (SPMD). One global step:

  1. sample prompts (the same global batch on every rank)
  2. generate n responses per prompt: colocated, each rank's engine generates its replica's share (gathered)
     and sleeps; with rollout.placement=separate the engine ranks generate it, up to trainer.max_staleness
     steps ahead, so the next steps' batches are generated while this one trains (schedule.py, spec section 8)
  3. score rewards with math-verify in killable workers (split over ranks, gathered), overlong shaping
  4. advantages (GRPO / Dr.GRPO / MCPO reweighting); DAPO dynamic sampling with over-sampling, or GCPO
  5. old log-probs with the Megatron policy (the PPO denominator and the hinge-KL anchor), and with
     algorithm.kl the frozen reference policy's (the reference-KL anchor)
  6. mini-batch updates: loss on the last pipeline stage from vocab-parallel logits, global token weights
  7. reshard the new weights into the engine (separate placement: into the trainer leader's copy, which the
     engines take before their next batch)
  8. metrics (JSONL, TensorBoard, progress bar), periodic eval, checkpoint (also on SIGTERM / SIGUSR1:
     at once when the signal arrives during generation, else at the end of the step; see preemption.py)
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mcpo_megatron import accounting
from mcpo_megatron.algorithms import kl, losses, mastery
from mcpo_megatron.config import Config, ConfigError, hinge_is_inert, model_shape, to_dict, to_yaml
from mcpo_megatron.parallel.distributed import (ParallelInfo, all_gather_objects, all_reduce_max, all_reduce_sum,
                                                barrier, broadcast_object)
from mcpo_megatron.rewards import types as reward_types
from mcpo_megatron.rollout.engine import GenerationInterrupted, SamplingParams
from mcpo_megatron.rollout.reshard import ReshardStats
from mcpo_megatron.trainer import run_dir, step_data
from mcpo_megatron.trainer.checkpoint import (CheckpointLoadError, CheckpointManager, capture_rng_state, find_latest,
                                              previous_complete, resolve_checkpoint, restore_rng_state, set_aside)
from mcpo_megatron.trainer.metrics import MetricsLogger, StepTimer, truncate_jsonl
from mcpo_megatron.trainer.preemption import StopRequest, lead_time_warning, signal_lead_s
from mcpo_megatron.trainer.setup import TrainingSetup, build_setup

PREEMPTED_FILE = "PREEMPTED"


def train(cfg: Config, info: ParallelInfo, bridge=None) -> dict:
    """Run ``cfg.trainer.total_steps`` global steps (resuming when configured); returns the last metrics.
    ``bridge``: with ``rollout.placement=separate``, the trainer leader's link to the engine ranks.

    On every exit path, an exception included, the logger closes, then the reward pool, then the engine: vLLM's
    shutdown destroys torch.distributed's default group, so the engine goes after the last collective and before
    the caller's teardown (``VLLMRolloutEngine.close``); engines on ranks of their own are told to stop. Rank 0
    holds the run directory's lock from before setup to after the engine has closed."""
    stop = StopRequest(enabled=cfg.checkpoint.save_on_signal)
    with contextlib.ExitStack() as closing:  # callbacks run last-in first-out
        closing.callback(stop.close)  # the previous signal handlers, last
        for lock in prepare_run_dir(cfg, info):
            closing.callback(lock.release)
        s: TrainingSetup = build_setup(cfg, info, bridge)
        closing.callback(s.close)  # the reward pool, then the engine
        return run_steps(cfg, info, s, stop, closing)


def run_steps(cfg: Config, info: ParallelInfo, s: TrainingSetup, stop: StopRequest,
              closing: contextlib.ExitStack) -> dict:
    """The body of :func:`train`; the logger it opens is closed through ``closing``."""
    out_dir = Path(cfg.trainer.output_dir)
    ckpt = CheckpointManager(cfg.checkpoint.dir or out_dir / "checkpoints", rank=info.rank,
                             local_rank=info.local_rank, keep_last=cfg.checkpoint.keep_last, barrier=barrier)
    start_step, log = start_run(cfg, info, s, ckpt, closing)
    metrics: dict = {}
    inert = hinge_is_inert(cfg)
    shape = model_shape(cfg)  # for the FLOP accounting of each step
    loss_fn = make_loss_fn(cfg)
    step = start_step
    last_checkpoint_s = 0.0
    lead_s, lead_warned = signal_lead_s(), False
    while step < cfg.trainer.total_steps:
        timer = StepTimer()
        # What a checkpoint of the previous step holds, should a signal arrive during this step's generation.
        step_start_state, step_start_rng = trainer_state(s, step), capture_rng_state()

        # ---- 1-4. rollouts, rewards, advantages, group filters ------------------------------------
        try:
            probe = submit_retention_probe(s, cfg, step)  # before the next steps' batches are submitted
            rollouts, gen_info = collect_rollouts(s, cfg, info, step, timer, should_stop=stop.requested)
            for warning in gen_info["warnings"]:
                log.write(f"step {step + 1}: warning: {warning}")
            if probe is not None:
                with timer("retention_probe"):
                    gen_info["retention_probe"] = take_retention_probe(s, probe, should_stop=stop.requested)
        except GenerationInterrupted:
            # The policy still holds the weights this step started from: checkpoint the previous step now.
            if ckpt.latest_step() != step:
                save_checkpoint(ckpt, s, cfg, step, step_start_state, rng_state=step_start_rng, log=log)
            log.write(f"{stop.signal_name or 'a signal'} received during generation: checkpointed step {step}, "
                      "exiting for requeue")
            mark_preempted(out_dir, step, info)
            break
        t_generated = time.perf_counter()
        s.rollouts.after_rollouts()  # a colocated engine sleeps: its memory goes to training
        rewards = step_data.shaped_rewards(rollouts, cfg)
        advantages = step_data.compute_advantages(rollouts, rewards, cfg)
        stats = mastery.group_stats(rollouts.correct.double(), rollouts.group_size,
                                    threshold=cfg.algorithm.mcpo.threshold)
        # R3: the engine's routing of the samples this rank trains (each rank held only its replica's)
        step_data.fetch_routing(rollouts, step_data.dp_shares(rollouts, cfg, info.dp)[info.dp_rank], info.rank)
        plan = step_data.plan_step(rollouts, advantages, rewards, stats.mastered, cfg,
                                   dp_rank=info.dp_rank, dp_size=info.dp)

        # ---- 5. old log-probs: the policy at the start of this global step (and the frozen reference's) -----
        with timer("old_logprobs"):
            compute_old_logprobs(s, plan)
        step_data.anchor_injected_references(plan, rollouts)
        mismatch = rollout_mismatch(plan, rollouts, info)

        # ---- 6. mini-batch updates ------------------------------------------------------------------
        with timer("train"):
            updates = update_policy(s, plan, loss_fn, cfg.algorithm.ppo_epochs)

        # ---- 7. reshard the new weights into the engine ---------------------------------------------
        with timer("reshard"):
            s.policy.sync_params()  # the distributed optimizer's deferred all-gather (overlap_param_gather)
            reshard_stats = s.rollouts.publish(s.resharder, version=step + 1)

        # ---- 8. metrics, eval, checkpoint ------------------------------------------------------------
        step += 1
        outcome = StepOutcome(rollouts, rewards, advantages, stats, gen_info, mismatch, updates, reshard_stats)
        metrics = step_record(s, cfg, info, outcome, step, timer, inert=inert, shape=shape)
        metrics["time/last_checkpoint"] = last_checkpoint_s
        # The longest a signal can wait for a checkpoint: it arrives as generation ends (preemption.py).
        metrics["time/preempt_lead_needed"] = time.perf_counter() - t_generated + last_checkpoint_s
        # The record is written before the checkpoint, so a crash during the save never loses a logged step;
        # the save's duration is reported with the next step (time/last_checkpoint).
        log.log(step, metrics)
        warning = None if lead_warned else lead_time_warning(metrics["time/preempt_lead_needed"], lead_s)
        if warning:
            log.write(warning)
            lead_warned = True
        stopping = stop.agreed()
        if stopping or step == cfg.trainer.total_steps or (
                cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0):
            last_checkpoint_s = save_checkpoint(ckpt, s, cfg, step, trainer_state(s, step), log=log)
        if stopping:
            log.write(f"{stop.signal_name or 'signal'} received: checkpointed step {step}, exiting for requeue")
            mark_preempted(out_dir, step, info)
            break

    log.close()
    if info.rank == 0 and cfg.logging.jsonl:
        accounting.write_summary(out_dir, world_size=info.world_size)
    return metrics


def start_run(cfg: Config, info: ParallelInfo, s: TrainingSetup, ckpt: CheckpointManager,
              closing: contextlib.ExitStack) -> tuple[int, MetricsLogger]:
    """Resume (when configured), open the run directory's logger, and give the engines the policy's weights;
    returns the first step to run and the logger (closed through ``closing``)."""
    out_dir = Path(cfg.trainer.output_dir)
    resume_from, state, rng = restore_checkpoint(s, cfg, info, ckpt)
    start_step = state["step"] if resume_from is not None else 0
    if info.rank == 0:
        truncate_jsonl(out_dir / "metrics.jsonl", start_step)
        (out_dir / PREEMPTED_FILE).unlink(missing_ok=True)
        (out_dir / "config.yaml").parent.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(to_yaml(cfg))
    log = MetricsLogger(out_dir, enabled=info.rank == 0, jsonl=cfg.logging.jsonl,
                        tensorboard=cfg.logging.tensorboard, wandb_cfg=cfg.logging.wandb,
                        total_steps=cfg.trainer.total_steps, initial_step=start_step, config_dict=to_dict(cfg))
    closing.callback(log.close)
    if resume_from is not None:
        log.write(f"resumed from {resume_from} at step {start_step}")
    if hinge_is_inert(cfg):
        log.write("warning: MCPO hinge-KL is inert (one optimizer step per global step): the old policy equals "
                  "the current one at every step, so the hinge never acts; logging hkl/inert=1")
    # The engines start from the policy's weights (loaded or resumed): version = global steps trained. A
    # colocated engine is awake from a weight update until the step's rollouts are done, asleep while training.
    s.rollouts.publish(s.resharder, version=start_step)
    if rng is not None:  # last, so that nothing before the first step draws from the restored generators
        restore_rng_state(rng)
    if resume_from is not None:  # the batches the checkpoint had submitted ahead, submitted again first
        s.schedule.load_state_dict(state.get("in_flight", []))
    return start_step, log


def step_record(s: TrainingSetup, cfg: Config, info: ParallelInfo, o: "StepOutcome", step: int, timer: StepTimer,
                *, inert: bool, shape) -> dict:
    """The record of (1-based) ``step``; the mastery tracker takes the step's groups, the periodic eval runs."""
    metrics = step_metrics(o, s.tracker, cfg, inert)
    metrics.update(async_metrics(o, step - 1, cfg, s.rollouts))
    # Mastery is tracked over every generated group, including those dynamic sampling dropped, with the
    # policy version that generated each group (spec section 8).
    seen, seen_stats = o.gen_info["seen"], o.gen_info["seen_stats"]
    s.tracker.update(seen.uids, seen_stats.p, seen_stats.mastered, step - 1,
                     versions=seen.versions[::seen.group_size].tolist())
    if cfg.eval.interval and step % cfg.eval.interval == 0:
        with timer("eval"):
            metrics.update(s.evaluate(step))
    metrics.update(timer.as_metrics())
    metrics.update(throughput_metrics(o, metrics, shape, cfg, info,
                                      logprob_passes=2 if s.ref_policy is not None else 1))
    return metrics


def resume_point(cfg: Config, ckpt: CheckpointManager) -> Path | None:
    """The checkpoint ``trainer.resume`` names: the latest one (auto), none (never), or the checkpoint at a path
    (a step_N directory, or the latest in a checkpoints directory)."""
    if cfg.trainer.resume == "auto":
        return find_latest(ckpt.root)
    if cfg.trainer.resume == "never":
        return None
    return resolve_checkpoint(cfg.trainer.resume)


def restore_checkpoint(s: TrainingSetup, cfg: Config, info: ParallelInfo, ckpt: CheckpointManager
                       ) -> tuple[Path | None, dict, dict | None]:
    """Collective: load the checkpoint ``trainer.resume`` names; returns its path, trainer state and this rank's
    RNG state ((None, {}, None): a fresh start). With ``trainer.resume=auto`` a complete checkpoint that cannot be
    loaded is reported and the previous complete one tried; once one loads, those that did not are set aside
    (``step_N.unloadable``), so that pruning never keeps them in place of good ones. An explicit path is not
    replaced: its error names the previous complete checkpoint."""
    path = resume_point(cfg, ckpt)
    if path is None:
        return None, {}, None
    failed: list[tuple[Path, CheckpointLoadError]] = []
    while True:
        try:
            state, rng = restore(s, ckpt, path)
            break
        except CheckpointLoadError as e:
            failed.append((path, e))
            previous = previous_complete(path)
            if cfg.trainer.resume != "auto":
                advice = (f"the previous complete checkpoint is {previous}: pass trainer.resume={previous}"
                          if previous is not None else "there is no earlier complete checkpoint beside it")
                raise CheckpointLoadError(f"trainer.resume={cfg.trainer.resume}: {e}; {advice}") from None
            if previous is None:
                raise CheckpointLoadError(f"no complete checkpoint in {ckpt.root} can be loaded:\n" + "\n".join(
                    f"  {p.name}: {err}" for p, err in failed)) from None
            if info.rank == 0:
                print(f"warning: checkpoint {path} cannot be loaded ({e}); falling back to the previous complete "
                      f"checkpoint {previous}", flush=True)
            path = previous
    if info.rank == 0:
        for bad, _ in failed:
            print(f"moved the checkpoint that cannot be loaded to {set_aside(bad)}", flush=True)
    return path, state, rng


def restore(s: TrainingSetup, ckpt: CheckpointManager, checkpoint: Path) -> tuple[dict, dict | None]:
    """Collective: load the policy, the data sampler and the mastery tracker of ``checkpoint``; returns its trainer
    state and this rank's RNG state. Raises :class:`CheckpointLoadError` on every rank when any rank cannot read
    its files or load the policy."""
    state, rng = on_every_rank(lambda: ckpt.read_state(checkpoint), checkpoint)
    on_every_rank(lambda: s.policy.load_checkpoint(checkpoint / "policy"), checkpoint)
    s.sampler.load_state_dict(state["sampler"])
    s.tracker.load_state_dict(state["tracker"])
    return state, rng


def on_every_rank(load, checkpoint: Path):
    """Collective: ``load()``, and when it failed on any rank, :class:`CheckpointLoadError` on all of them (one
    object all-gather over the world: CPU, gloo), so that no rank goes on to a collective the others never reach.
    A file only some ranks read (this rank's RNG file) can fail on one rank; a failure inside megatron's policy load
    is raised on every rank by torch.distributed.checkpoint itself, before this gather."""
    result, error = None, None
    try:
        result = load()
    except Exception as e:  # noqa: BLE001  any failure to load is this checkpoint's, reported on every rank
        error = str(e) if isinstance(e, CheckpointLoadError) else f"{checkpoint}: {type(e).__name__}: {e}"
    gathered = all_gather_objects(error)
    errors = [(rank, err) for rank, err in enumerate(gathered) if err is not None]
    if errors:
        rank, err = errors[0]
        if len(gathered) > 1:
            err += f" (on rank {rank}" + (f" and {len(errors) - 1} other rank(s))" if len(errors) > 1 else ")")
        raise CheckpointLoadError(err)
    return result


def compute_old_logprobs(s: TrainingSetup, plan: step_data.StepPlan) -> None:
    """The policy's log-probs at the start of the step (PPO denominator, hinge anchor) into each mini-batch,
    and with algorithm.kl the frozen reference's."""
    for mb in plan.minibatches:
        old_logp, _ = s.policy.compute_logprobs(mb, compute_entropy=False)
        mb.token_fields["old_logp"] = [x.float() for x in old_logp]
        if s.ref_policy is not None:
            ref_logp, _ = s.ref_policy.compute_logprobs(mb, compute_entropy=False)
            mb.token_fields["ref_logp"] = [x.float() for x in ref_logp]


@dataclass
class PolicyUpdates:
    """The optimizer steps of one global step: loss metric sums added over them, and each one's grad norm."""

    sums: dict[str, float] = field(default_factory=dict)
    grad_norms: list[float] = field(default_factory=list)
    lr_sum: float = 0.0
    skipped: float = 0.0
    microbatches: float = 0.0
    filler_microbatches: float = 0.0


def update_policy(s: TrainingSetup, plan: step_data.StepPlan, loss_fn, ppo_epochs: int) -> PolicyUpdates:
    """``ppo_epochs`` passes over the step's mini-batches, one optimizer step each."""
    u = PolicyUpdates()
    for _epoch in range(ppo_epochs):
        for mb in plan.minibatches:
            out = s.policy.train_step(mb, loss_fn)
            u.grad_norms.append(float(out.pop("grad_norm")))
            u.lr_sum += float(out.pop("lr", 0.0))
            u.skipped += float(out.pop("skipped", 0.0))
            u.microbatches += float(out.pop("num_microbatches", 0.0))
            u.filler_microbatches += float(out.pop("num_filler_microbatches", 0.0))
            for k, v in out.items():
                u.sums[k] = u.sums.get(k, 0.0) + float(v)
    return u


@dataclass
class StepOutcome:
    """What one global step produced: the input of its metrics record."""

    rollouts: step_data.Rollouts
    rewards: torch.Tensor
    advantages: torch.Tensor
    stats: mastery.GroupStats
    gen_info: dict  # collect_rollouts' account of generation (and the retention probe's results)
    mismatch: dict[str, float]
    updates: PolicyUpdates
    reshard: ReshardStats


def throughput_metrics(o: StepOutcome, metrics: dict, shape, cfg: Config, info: ParallelInfo, *,
                       logprob_passes: int) -> dict:
    """Tokens, FLOPs, MFU and peak memory of the step (accounting.step_accounting; reads the step's timings)."""
    prompt_lens, response_lens = accounting.iter_lengths(o.rollouts.prompt_ids, o.rollouts.response_ids,
                                                         o.rollouts.group_size)
    separate = cfg.rollout.placement == "separate"  # engines on devices of their own, for their own seconds
    work = accounting.StepWork(
        prompt_lens, response_lens, gen_prompt_lens=o.gen_info["gen_prompt_lens"],
        gen_response_lens=o.gen_info["gen_response_lens"], ppo_epochs=cfg.algorithm.ppo_epochs,
        logprob_passes=logprob_passes)
    devices = accounting.StepDevices(
        info.world_size + (cfg.rollout.ranks if separate else 0), train_world_size=info.world_size,
        rollout_world_size=cfg.rollout.ranks if separate else None,
        generation_time_key="time/engine_generate" if separate else "time/rollout")
    return accounting.step_accounting(shape, metrics, work, devices,
                                      peak_bytes=accounting.peak_memory_bytes(all_ranks=True))


def trainer_state(s: TrainingSetup, step: int) -> dict:
    """What a checkpoint of ``step`` holds besides the policy: the data sampler, the mastery tracker and the
    generation batches in flight (submitted ahead of their step with separate placement)."""
    return {"step": step, "sampler": s.sampler.state_dict(), "tracker": s.tracker.state_dict(),
            "in_flight": s.schedule.state_dict()}


def save_checkpoint(ckpt: CheckpointManager, s: TrainingSetup, cfg: Config, step: int, state: dict, *,
                    rng_state: dict | None = None, log) -> float:
    """Collective: checkpoint ``step`` (the policy as it is now); returns the seconds it took."""
    t0 = time.perf_counter()
    ckpt.save(step, save_policy=s.policy.save_checkpoint, config_yaml=to_yaml(cfg), trainer_state=state,
              rng_state=rng_state)
    seconds = time.perf_counter() - t0
    log.write(f"checkpoint step {step} saved in {seconds:.1f} s")
    return seconds


def mark_preempted(out_dir: Path, step: int, info: ParallelInfo) -> None:
    """The file the sbatch script reads to requeue the job (rank 0 writes it)."""
    if info.rank == 0:
        (out_dir / PREEMPTED_FILE).write_text(f"{step}\n")


def prepare_run_dir(cfg: Config, info: ParallelInfo) -> list[run_dir.RunLock]:
    """Rank 0 locks the run's directories for the run's life (refused while another run holds them), refuses a
    resume path without a checkpoint or a fresh run into another run's directory or, with trainer.overwrite,
    moves that run aside (trainer/run_dir.py);
    returns rank 0's locks. Every rank gets the outcome, so all stop, with rank 0's error, or all go on."""
    refusal, locks = None, []
    if info.rank == 0:
        try:
            locks = run_dir.lock_run_dirs(cfg)  # first: never move aside a directory a live run writes
            run_dir.check_run_dir(cfg)
            moved = run_dir.move_aside(cfg)
            for old, new in moved:
                print(f"trainer.overwrite=true: moved the run in {old} to {new}", flush=True)
            if moved:  # the lock files went with the old run: lock the new directories
                old_locks, locks = locks, []
                locks = run_dir.lock_run_dirs(cfg)
                for lock in old_locks:
                    lock.release()
        except (ConfigError, run_dir.RunDirInUse) as e:
            refusal = (type(e), e.problems if isinstance(e, ConfigError) else str(e))
        if refusal:
            for lock in locks:
                lock.release()
    refusal = broadcast_object(refusal)
    if refusal:
        error_type, detail = refusal
        raise error_type(detail)
    return locks


def collect_rollouts(s: TrainingSetup, cfg: Config, info: ParallelInfo, step: int, timer: StepTimer, *,
                     should_stop=None):
    """Generate and score one batch; with DAPO dynamic sampling, over-sample until the batch is full.
    ``should_stop`` is polled while generating (:class:`GenerationInterrupted` ends the step). A batch whose
    samples come from a policy more than ``trainer.max_staleness`` versions old is dropped (and counted)."""
    want = cfg.data.train_batch_size
    kept: list[step_data.Rollouts] = []
    generated: list[step_data.Rollouts] = []
    num_kept, gen_batches, filter_counts = 0, 0, {}
    gen_prompt_lens, gen_response_lens, batches, stale_samples = [], [], [], 0
    while True:
        with timer("rollout"):
            planned, gen = s.schedule.take(step, gen_batches, should_stop=should_stop)
        out = gen.output
        with timer("reward"):
            batch = s.score(planned.prompt_idx, out, cfg.rollout.n, version=gen.version)
        gen_prompt_lens += [len(s.prompt_ids[planned.prompt_idx[x.prompt_index]]) for x in out.samples]
        gen_response_lens += [len(t) for t in out.token_ids]
        gen_batches += 1
        batches.append(gen)
        generated.append(batch)
        if step - gen.version > cfg.trainer.max_staleness:  # never trained on (spec section 8)
            stale_samples += batch.num_samples
            batch = batch.select_groups([])
        if cfg.algorithm.gcpo.enable:
            batch = s.inject_references(batch)
        if not cfg.algorithm.filter_groups.enable:
            kept = [batch]
            num_kept = batch.num_groups
            break
        keep, counts = step_data.dynamic_sampling_keep(batch)
        for k, v in counts.items():
            filter_counts[k] = filter_counts.get(k, 0) + int(v)
        kept.append(batch.select_groups(keep))
        num_kept += len(keep)
        if num_kept >= want or gen_batches >= cfg.algorithm.filter_groups.max_gen_batches:
            break
    rollouts = step_data.Rollouts.concat(kept)
    if rollouts.num_groups > want:  # DAPO keeps exactly one batch of groups
        rollouts = rollouts.select_groups(list(range(want)))
    if rollouts.num_groups == 0:
        raise RuntimeError(
            f"dynamic sampling kept no group after {gen_batches} generation batches (every group was all-correct "
            "or all-wrong, or too stale): raise algorithm.filter_groups.max_gen_batches or use an easier/harder "
            "prompt set")
    warnings = []
    if cfg.algorithm.filter_groups.enable:
        # verl raises here; training on fewer groups is allowed, but said in the log and the record.
        filter_counts["partial_batch"] = int(num_kept < want)
        if num_kept < want:
            warnings.append(f"dynamic sampling: {num_kept} of {want} groups after algorithm.filter_groups."
                            f"max_gen_batches={gen_batches} generation batches; training on a partial batch "
                            "(filter/partial_batch=1)")
    if stale_samples:
        warnings.append(f"{stale_samples} samples generated more than trainer.max_staleness="
                        f"{cfg.trainer.max_staleness} versions ago were dropped")
    info_out = {"gen_batches": gen_batches, "filter_counts": filter_counts, "batches": batches,
                "stale_samples": stale_samples, "generated_samples": sum(b.num_samples for b in generated),
                "gen_prompt_lens": gen_prompt_lens, "gen_response_lens": gen_response_lens, "warnings": warnings}
    # mastery needs the outcomes only: the engine's routing (R3) stays with the step's own rollouts
    info_out["seen"] = dataclasses.replace(step_data.Rollouts.concat(generated), routed_experts=None,
                                           routing_ranks=None)
    info_out["seen_stats"] = mastery.group_stats(info_out["seen"].correct, cfg.rollout.n,
                                                 threshold=cfg.algorithm.mcpo.threshold)
    return rollouts, info_out


def submit_retention_probe(s: TrainingSetup, cfg: Config, step: int):
    """Extra rollouts on the previous step's mastered prompts (paper Fig. 7; scored, never trained on), submitted
    before the step's own batches are taken, so the engines generate them next. Returns its key, or None."""
    prev_mastered = s.tracker.mastered_at(step - 1)
    if not (cfg.diagnostics.retention_probe and prev_mastered):
        return None
    prompt_idx = [s.uid_to_index[u] for u in prev_mastered]
    sampling = s.schedule.sampling(step, "retention_probe")
    sampling = SamplingParams(**{**sampling.__dict__, "n": cfg.diagnostics.retention_probe_n})
    key = (step, "retention_probe")
    s.rollouts.submit(key, [s.prompt_ids[i] for i in prompt_idx], sampling,
                      min_version=step - cfg.trainer.max_staleness)
    return key, prompt_idx, sampling.n


def take_retention_probe(s: TrainingSetup, probe, *, should_stop=None) -> list[float]:
    key, prompt_idx, n = probe
    gen = s.rollouts.result(key, should_stop=should_stop)
    return [float(c) for c in s.score(prompt_idx, gen.output, n, version=gen.version).correct.tolist()]


def make_loss_fn(cfg: Config):
    """The configured surrogate (spec section 1-2) for ``MegatronPolicy.train_step``."""
    a = cfg.algorithm
    settings = losses.LossSettings.from_config(a)

    def loss_fn(logp, entropy, mb):
        f = mb.token_fields
        return losses.policy_loss(
            logp, f["old_logp"], f["advantages"], f["pg_weight"], mb.mask, settings,
            hkl_weight=f["hkl_weight"] if a.mcpo.hinge_kl.enable else None,
            ref_logp=f["ref_logp"] if a.kl.enable else None,
            rollout_logp=f["rollout_logp"] if a.tis.enable else None, entropy=entropy)

    return loss_fn


def rollout_mismatch(plan: step_data.StepPlan, r: step_data.Rollouts, info: ParallelInfo) -> dict[str, float]:
    """Engine vs trainer log-probs on the sampled tokens: mean k3 KL(engine || trainer) and max |diff|."""
    k3_sum, n, max_abs = 0.0, 0, 0.0
    for mb, local in zip(plan.minibatches, plan.local_samples):
        for j, sample in enumerate(local):
            old, roll = mb.token_fields["old_logp"][j], mb.token_fields["rollout_logp"][j]
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


def async_metrics(o: StepOutcome, step: int, cfg: Config, rollouts) -> dict:
    """Spec section 8's account of a step (0-based ``step``): how old the trained samples' policy was, what was
    dropped for staleness, and with engines on ranks of their own, where the engines' time went and how the
    weights travelled (GB/s over the engines' receive time)."""
    r, g = o.rollouts, o.gen_info
    staleness = (step - r.versions).double()
    m = {"async/staleness_mean": float(staleness.mean()), "async/staleness_max": float(staleness.max()),
         "async/policy_version_min": int(r.versions.min()),
         "async/stale_dropped_frac": g["stale_samples"] / max(g["generated_samples"], 1)}
    if cfg.rollout.placement == "separate":
        batches = g["batches"]
        updates = [u for b in batches for u in b.updates]
        seconds, nbytes = sum(u.transfer_s for u in updates), sum(u.bytes for u in updates)
        m.update({"time/engine_generate": sum(b.generate_s for b in batches),
                  "time/engine_idle": sum(b.idle_s for b in batches),
                  "time/engine_weight_wait": sum(u.wait_s for u in updates),
                  "time/publish_wait": rollouts.publish_wait_s,
                  "async/weight_updates": len(updates), "async/weight_bytes": nbytes,
                  "reshard/transfer_s": seconds, "reshard/transfer_gbps": nbytes / seconds / 1e9 if seconds else 0.0})
    return m


def step_metrics(o: StepOutcome, tracker: mastery.MasteryTracker, cfg: Config, inert: bool) -> dict:
    """The per-step record (spec and issue: what a step shows)."""
    r, rewards, advantages, stats, gen_info = o.rollouts, o.rewards, o.advantages, o.stats, o.gen_info
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
        "batch/gen_batches": gen_info["gen_batches"],
        "actor/grad_norm": sum(o.updates.grad_norms) / max(len(o.updates.grad_norms), 1),
        "hkl/inert": 1 if inert else 0,
        "reshard/seconds": o.reshard.seconds,
        "reshard/gbps": o.reshard.gbps,
        **o.mismatch,
    }
    for status, count in reward_types.count_statuses(r.statuses).items():
        m[f"reward/status_{status}"] = count
    for k, v in gen_info["filter_counts"].items():
        m[f"filter/{k}"] = v
    if r.gcpo_injected.numel():
        m["gcpo/injected"] = int(r.gcpo_injected.sum())
    steps = max(len(o.updates.grad_norms), 1)
    m["actor/lr"] = o.updates.lr_sum / steps
    m["actor/skipped_steps"] = o.updates.skipped
    m["actor/microbatches"] = o.updates.microbatches
    # passes run only so that expert-parallel peers meet in every all-to-all (models.policy)
    m["actor/filler_microbatches"] = o.updates.filler_microbatches
    loss_sums = dict(o.updates.sums)
    for key in [k for k in loss_sums if k.startswith("moe/")]:  # expert load: mean over optimizer steps
        m[key] = loss_sums.pop(key) / steps
    m.update(losses.finalize_metrics(loss_sums))
    # Retention (paper Fig. 7): accuracy under the current policy of prompts mastered when last seen, from
    # the prompts that recur in this batch and, with diagnostics.retention_probe, from extra probe rollouts.
    m["retention/acc"], m["retention/prompts"] = tracker.retention(gen_info["seen"].uids, gen_info["seen_stats"].p)
    probe = gen_info.get("retention_probe")
    if probe is not None:
        m["retention/probe_acc"] = sum(probe) / len(probe) if probe else float("nan")
        m["retention/probe_samples"] = len(probe)
    return m
