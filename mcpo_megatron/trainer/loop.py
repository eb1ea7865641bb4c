"""The training loop: MCPO (and GRPO / DAPO / Dr.GRPO / GSPO / GCPO) end to end, one global step at a time.

Read top to bottom: the helpers follow :func:`run_steps` in the order it calls them. Every rank runs this same
function (SPMD). One global step:

  1. sample prompts (the same global batch on every rank)
  2. generate n responses per prompt: colocated, each rank's engine generates its replica's share (gathered)
     and sleeps; with rollout.placement=separate the engine ranks generate it, up to trainer.max_staleness
     steps ahead, so the next steps' batches are generated while this one trains (schedule.py, docs/algorithms.md §13);
     with rollout.partial the step's generation ends once its groups are complete and the unfinished responses
     continue in the next step (partial_schedule.py, §13.1)
  3. score rewards with math-verify in killable workers (split over ranks, gathered); DAPO dynamic sampling
     with over-sampling, or GCPO reference answers
  4. shaped rewards and advantages (GRPO / Dr.GRPO / MCPO reweighting), the mini-batches of each rank
  5. old log-probs with the Megatron policy (the PPO denominator and the hinge-KL anchor), and with
     algorithm.kl the frozen reference policy's (the reference-KL anchor); the off-policy masks from them
  6. mini-batch updates: loss on the last pipeline stage from vocab-parallel logits, global token weights
  7. reshard the new weights into the engine (separate placement: into the trainer leader's copy, which the
     engines take before their next batch)
  8. metrics (JSONL, TensorBoard, progress bar), periodic eval, checkpoint (also on SIGTERM / SIGUSR1:
     at once when the signal arrives during generation, else at the end of the step; see preemption.py); with
     separate placement a checkpoint holds the batches the engines were generating, finished (held_batches.py)

What the phases hand each other is typed in step_data.py (``Rollouts``, ``Generation``, ``StepOutcome``); the
record is built in metrics.py, checkpoints are saved and resumed in resume.py, and what the loop uses is built once
in setup.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path

from mcpo_megatron import accounting
from mcpo_megatron.algorithms import losses, mastery, off_policy
from mcpo_megatron.config import Config, hinge_is_inert, model_shape, to_dict, to_yaml
from mcpo_megatron.parallel.distributed import ParallelInfo
from mcpo_megatron.rollout.engines.interface import GenerationInterrupted, SamplingParams
from mcpo_megatron.trainer import run_dir, step_data
from mcpo_megatron.trainer.checkpoint import CheckpointManager, capture_rng_state, restore_rng_state
from mcpo_megatron.trainer.metrics import (MetricsLogger, StepTimer, async_metrics, off_policy_metrics, offload_metrics,
                                           rollout_mismatch, step_metrics, throughput_metrics, truncate_jsonl)
from mcpo_megatron.trainer.preemption import StopRequest, lead_time_warning, signal_lead_s
from mcpo_megatron.trainer.resume import (PREEMPTED_FILE, checkpoint_manager, mark_preempted, restore_checkpoint,
                                          save_checkpoint, trainer_state)
from mcpo_megatron.trainer.setup import TrainingSetup, build_setup
from mcpo_megatron.trainer.startup import StartupClock
from mcpo_megatron.trainer.step_data import Generation, PolicyUpdates, Rollouts, StepOutcome, StepPlan


def train(cfg: Config, info: ParallelInfo, bridge=None, clock: StartupClock | None = None) -> dict:
    """Run ``cfg.trainer.total_steps`` global steps (resuming when configured); returns the last metrics.
    ``bridge``: with ``rollout.placement=separate``, this trainer rank's link to the engine ranks. ``clock``: the
    start-up's phases so far (imports, process groups), continued to the first step.

    On every exit path, an exception included, the logger closes, then the reward pool, then the engine: vLLM's
    shutdown destroys torch.distributed's default group, so the engine goes after the last collective and before
    the caller's teardown (``VLLMRolloutEngine.close``); engines on ranks of their own are told to stop. Rank 0
    holds the run directory's lock from before setup to after the engine has closed."""
    stop = StopRequest(enabled=cfg.checkpoint.save_on_signal)
    with contextlib.ExitStack() as closing:  # callbacks run last-in first-out
        closing.callback(stop.close)  # the previous signal handlers, last
        for lock in run_dir.prepare_run_dir(cfg, info):
            closing.callback(lock.release)
        s = build_setup(cfg, info, bridge, clock)
        closing.callback(s.close)  # the reward pool, then the engine
        return run_steps(s, stop, closing)


def run_steps(s: TrainingSetup, stop: StopRequest, closing: contextlib.ExitStack) -> dict:
    """The body of :func:`train`: resume, then global steps until ``trainer.total_steps`` or a preemption signal;
    returns the last step's record. The logger it opens is closed through ``closing``."""
    cfg = s.cfg
    ckpt = checkpoint_manager(cfg, s.info)
    step, log = start_run(s, ckpt, closing)
    loss_fn = make_loss_fn(cfg)
    inert, shape = hinge_is_inert(cfg), model_shape(cfg)  # shape: for the FLOP accounting of each step
    metrics: dict = {}
    last_checkpoint_s = 0.0
    lead_s, lead_warned = signal_lead_s(), False
    startup_logged = False
    while step < cfg.trainer.total_steps:
        timer = StepTimer()
        # What a checkpoint of the previous step holds, should a signal arrive during this step's generation.
        at_start = trainer_state(s, step), capture_rng_state()

        # ---- 1-3. rollouts and their rewards, group filters (and the retention probe) ---------------------
        try:
            rollouts, generation = generate(s, step, timer, stop, log)
        except GenerationInterrupted:
            # The policy still holds the weights this step started from: checkpoint the previous step now, with
            # the batches generated for this step meanwhile (separate placement: the engines finished them). Whether
            # it is checkpointed already is rank 0's view, on every rank (latest_step is collective).
            if ckpt.latest_step() != step:
                save_checkpoint(ckpt, s, step, {**at_start[0], **s.schedule.held.state_dict(step)}, at_start[1],
                                log=log)
            log.write(f"{stop.signal_name or 'a signal'} received during generation: checkpointed step {step}, "
                      "exiting for requeue")
            mark_preempted(s, step)
            break
        t_generated = time.perf_counter()
        # A colocated engine sleeps: its memory goes to training (with trainer.offload the state comes back now,
        # having left the GPU at the last weight update).
        s.rollouts.after_rollouts()

        # ---- 4-7. advantages, old log-probs, mini-batch updates, the new weights into the engines ----------
        outcome = train_on(s, rollouts, generation, step, timer, loss_fn)

        # ---- 8. metrics, eval, checkpoint ------------------------------------------------------------
        step += 1
        metrics = record_step(s, outcome, step, timer, inert=inert, shape=shape)
        if not startup_logged:
            metrics.update(s.startup.metrics())  # the first step of this process's run
            startup_logged = True
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
            t_checkpoint = time.perf_counter()
            s.schedule.finish_in_flight()  # separate placement: the checkpoint holds the next batches, generated
            save_checkpoint(ckpt, s, step, trainer_state(s, step), log=log)
            last_checkpoint_s = time.perf_counter() - t_checkpoint
        if stopping:
            log.write(f"{stop.signal_name or 'signal'} received: checkpointed step {step}, exiting for requeue")
            mark_preempted(s, step)
            break

    log.close()
    if s.info.rank == 0 and cfg.logging.jsonl:
        accounting.write_summary(Path(cfg.trainer.output_dir), world_size=s.info.world_size)
    return metrics


def start_run(s: TrainingSetup, ckpt: CheckpointManager, closing: contextlib.ExitStack) -> tuple[int, MetricsLogger]:
    """Resume (when configured), open the run directory's logger, and give the engines the policy's weights;
    returns the first step to run and the logger (closed through ``closing``)."""
    cfg, info = s.cfg, s.info
    out_dir = Path(cfg.trainer.output_dir)
    s.startup.mark("weight plan and reward workers")
    resume_from, state, rng = restore_checkpoint(s, ckpt)
    start_step = state["step"] if resume_from is not None else 0
    if resume_from is not None:
        s.startup.mark("resume")
    if info.rank == 0:
        truncate_jsonl(out_dir / "metrics.jsonl", start_step)
        (out_dir / PREEMPTED_FILE).unlink(missing_ok=True)
        (out_dir / "config.yaml").parent.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(to_yaml(cfg))
    log = MetricsLogger(out_dir, cfg.logging, enabled=info.rank == 0, total_steps=cfg.trainer.total_steps,
                        initial_step=start_step, config_dict=to_dict(cfg))
    closing.callback(log.close)
    if resume_from is not None:
        log.write(f"resumed from {resume_from} at step {start_step}")
    if hinge_is_inert(cfg):
        log.write("warning: MCPO hinge-KL is inert (one optimizer step per global step): the old policy equals "
                  "the current one at every step, so the hinge never acts; logging hkl/inert=1")
    # The engines start from the policy's weights (loaded or resumed): version = global steps trained. A
    # colocated engine is awake from a weight update until the step's rollouts are done, asleep while training;
    # with trainer.offload the training state is in host memory while it is awake.
    s.rollouts.publish(s.resharder, version=start_step)
    s.startup.mark("first weight update")
    log.write(s.startup.line())
    if rng is not None:  # last, so that nothing before the first step draws from the restored generators
        restore_rng_state(rng)
    if resume_from is not None:  # the batches the checkpoint had submitted ahead (and its unfinished responses)
        s.schedule.load_state_dict(state)
    return start_step, log


def make_loss_fn(cfg: Config):
    """The configured surrogate (docs/algorithms.md §4-§8) for ``MegatronPolicy.train_step``."""
    a = cfg.algorithm
    settings = losses.LossSettings.from_config(a)
    masked = off_policy.MaskSettings.from_config(a).enabled

    def loss_fn(logp, entropy, mb):
        f = mb.token_fields
        # an episode's tool outputs (model_mask 0) are in no term: not in the PG term, the KLs, the entropy, nor in
        # GSPO's sequence ratio or any count
        mask = mb.mask & (f["model_mask"] > 0) if "model_mask" in f else mb.mask
        inputs = losses.LossInputs(
            logp, f["old_logp"], f["advantages"], f["pg_weight"], mask,
            hkl_weight=f["hkl_weight"] if a.mcpo.hinge_kl.enable else None,
            ref_logp=f["ref_logp"] if a.kl.enable else None,
            rollout_logp=f["rollout_logp"] if a.tis.enable else None, entropy=entropy,
            behaviour_mask=f["behaviour_mask"] if masked else None)
        return losses.policy_loss(inputs, settings)

    return loss_fn


# ---------------------------------------------------------------------------------------------------- 1-3
def generate(s: TrainingSetup, step: int, timer: StepTimer, stop: StopRequest,
             log: MetricsLogger) -> tuple[Rollouts, Generation]:
    """The step's scored rollouts (:func:`collect_rollouts`) and, with diagnostics.retention_probe, the probe's.
    :class:`GenerationInterrupted` when a preemption signal arrives meanwhile: colocated the engines stop at their
    next decoding step; engines on ranks of their own finish the step's batches first (the checkpoint holds them)."""
    probe = submit_retention_probe(s, step)  # before the next steps' batches are submitted
    rollouts, generation = collect_rollouts(s, step, timer, should_stop=stop.requested)
    for warning in generation.warnings:
        log.write(f"step {step + 1}: warning: {warning}")
    if probe is not None:
        with timer("retention_probe"):
            generation.retention_probe = take_retention_probe(s, probe, should_stop=stop.requested)
    if s.schedule.held.finishes and stop.agreed():  # separate placement: the batches were waited for to the end
        raise GenerationInterrupted(f"a signal arrived while step {step + 1}'s batches were generated")
    return rollouts, generation


def submit_retention_probe(s: TrainingSetup, step: int):
    """Extra rollouts on the previous step's mastered prompts (paper Fig. 7; scored, never trained on), submitted
    before the step's own batches are taken, so the engines generate them next. Returns its key, or None."""
    cfg = s.cfg
    prev_mastered = s.tracker.mastered_at(step - 1)
    if not (cfg.diagnostics.retention_probe and prev_mastered):
        return None
    prompt_idx = [s.uid_to_index[u] for u in prev_mastered]
    sampling = s.schedule.sampling(step, "retention_probe")
    sampling = SamplingParams(**{**sampling.__dict__, "n": cfg.diagnostics.retention_probe_n})
    key = (step, "retention_probe")
    # the policy the step starts from (published by now), whichever version the engines held before
    s.rollouts.submit(key, [s.prompt_ids[i] for i in prompt_idx], sampling, min_version=step)
    return key, prompt_idx, sampling.n


def collect_rollouts(s: TrainingSetup, step: int, timer: StepTimer, *,
                     should_stop=None) -> tuple[Rollouts, Generation]:
    """Generate and score one batch; with DAPO dynamic sampling, over-sample until the batch is full.
    ``should_stop`` is polled while generating (:class:`GenerationInterrupted` ends the step). A batch whose
    samples come from a policy more than ``trainer.max_staleness`` versions old is dropped (and counted)."""
    cfg = s.cfg
    want, dynamic = cfg.data.train_batch_size, cfg.algorithm.filter_groups.enable
    batches, generated, kept = [], [], []  # as generated, as scored, the groups kept for training
    stale_samples, filter_counts = 0, {}
    while True:
        with timer("rollout"):
            planned, gen = s.schedule.take(step, len(batches), should_stop=should_stop)
        with timer("reward"):
            batch = step_data.score(s, planned.prompt_idx, gen.output, cfg.rollout.n, version=gen.version)
        batches.append(gen)
        generated.append(batch)
        if step - gen.version > cfg.trainer.max_staleness:  # never trained on (docs/algorithms.md §13)
            stale_samples += batch.num_samples
            batch = batch.select_groups([])
        if cfg.algorithm.gcpo.enable:
            batch = step_data.inject_references(batch, s.references, cfg)
        if not dynamic:
            kept = [batch]
            break
        keep, counts = step_data.dynamic_sampling_keep(batch)
        for k, v in counts.items():
            filter_counts[k] = filter_counts.get(k, 0) + int(v)
        kept.append(batch.select_groups(keep))
        if sum(b.num_groups for b in kept) >= want or len(batches) >= cfg.algorithm.filter_groups.max_gen_batches:
            break
    rollouts = Rollouts.concat(kept)
    if rollouts.num_groups > want:  # DAPO keeps exactly one batch of groups
        rollouts = rollouts.select_groups(list(range(want)))
    if rollouts.num_groups == 0:
        raise RuntimeError(
            f"dynamic sampling kept no group after {len(batches)} generation batches (every group was all-correct "
            "or all-wrong, or too stale): raise algorithm.filter_groups.max_gen_batches or use an easier/harder "
            "prompt set")
    warnings = []
    if dynamic:
        # verl raises here; training on fewer groups is allowed, but said in the log and the record.
        num_kept = sum(b.num_groups for b in kept)
        filter_counts["partial_batch"] = int(num_kept < want)
        if num_kept < want:
            warnings.append(f"dynamic sampling: {num_kept} of {want} groups after algorithm.filter_groups."
                            f"max_gen_batches={len(batches)} generation batches; training on a partial batch "
                            "(filter/partial_batch=1)")
    if stale_samples:
        warnings.append(f"{stale_samples} samples generated more than trainer.max_staleness="
                        f"{cfg.trainer.max_staleness} versions ago were dropped")
    # mastery needs the outcomes only: the engine's routing (R3) stays with the step's own rollouts
    seen = dataclasses.replace(Rollouts.concat(generated), routed_experts=None, routing_ranks=None)
    seen_stats = mastery.group_stats(seen.correct, cfg.rollout.n, threshold=cfg.algorithm.mcpo.threshold)
    return rollouts, Generation(batches, seen, seen_stats, stale_samples, filter_counts, warnings)


def take_retention_probe(s: TrainingSetup, probe, *, should_stop=None) -> list[float]:
    """The probe's samples, scored: 0/1 correct per sample."""
    key, prompt_idx, n = probe
    gen = s.rollouts.result(key, should_stop=should_stop)
    return [float(c) for c in step_data.score(s, prompt_idx, gen.output, n, version=gen.version).correct.tolist()]


# ---------------------------------------------------------------------------------------------------- 4-7
def train_on(s: TrainingSetup, rollouts: Rollouts, generation: Generation, step: int, timer: StepTimer,
             loss_fn) -> StepOutcome:
    """Global step ``step`` (0-based) on ``rollouts``: advantages, the step's plan for this rank, old log-probs,
    ``algorithm.ppo_epochs`` passes of mini-batch updates, then the new weights published to the engines."""
    cfg, info = s.cfg, s.info
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
    # algorithm.token_mask / sequence_mask: the PG term's off-policy masks, from old_logp and the engine's log-probs
    masks = off_policy.MaskSettings.from_config(cfg.algorithm)
    step_data.mask_off_policy_tokens(plan, rollouts, masks)
    mismatch = rollout_mismatch(plan, rollouts, info)
    mismatch.update(off_policy_metrics(plan, rollouts, info, masks.sequence_ratio))

    # ---- 6. mini-batch updates ------------------------------------------------------------------
    with timer("train"):
        updates = update_policy(s, plan, loss_fn, cfg.algorithm.ppo_epochs)

    # ---- 7. reshard the new weights into the engine ---------------------------------------------
    with timer("reshard"):
        s.policy.sync_params()  # the distributed optimizer's deferred all-gather (overlap_param_gather)
        reshard = s.rollouts.publish(s.resharder, version=step + 1)
    return StepOutcome(rollouts, rewards, advantages, stats, generation, mismatch, updates, reshard)


def compute_old_logprobs(s: TrainingSetup, plan: StepPlan) -> None:
    """The policy's log-probs at the start of the step (PPO denominator, hinge anchor) into each mini-batch,
    and with algorithm.kl the frozen reference's."""
    for mb in plan.minibatches:
        old_logp, _ = s.policy.compute_logprobs(mb, compute_entropy=False)
        mb.token_fields["old_logp"] = [x.float() for x in old_logp]
        if s.ref_policy is not None:
            ref_logp, _ = s.ref_policy.compute_logprobs(mb, compute_entropy=False)
            mb.token_fields["ref_logp"] = [x.float() for x in ref_logp]


def update_policy(s: TrainingSetup, plan: StepPlan, loss_fn, ppo_epochs: int) -> PolicyUpdates:
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


# ---------------------------------------------------------------------------------------------------- 8
def record_step(s: TrainingSetup, o: StepOutcome, step: int, timer: StepTimer, *, inert: bool, shape) -> dict:
    """The record of (1-based) ``step``; the mastery tracker takes the step's groups, the periodic eval runs."""
    record = step_metrics(o, s.tracker, s.cfg, inert)
    record.update(async_metrics(o, step - 1, s.rollouts))
    record.update(offload_metrics(s.rollouts))
    # Mastery is tracked over every generated group, including those dynamic sampling dropped, with the
    # policy version that generated each group (docs/algorithms.md §13).
    seen, seen_stats = o.generation.seen, o.generation.seen_stats
    s.tracker.update(seen.uids, seen_stats.p, seen_stats.mastered, step - 1,  # a group's version: its oldest token's
                     versions=seen.versions.view(-1, seen.group_size).min(dim=1).values.tolist())
    if s.cfg.eval.interval and step % s.cfg.eval.interval == 0:
        with timer("eval"):
            record.update(s.evaluate(step))
    record.update(timer.as_metrics())
    record.update(throughput_metrics(s, o, record, shape))
    return record
