"""Builds what the training loop uses: model files, tokenizer, prompts, sampler, policy, engine, resharder,
reward scorer (the components themselves come from components.py). Kept apart from ``loop.py`` so the loop reads
as the algorithm, not as plumbing."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mcpo_megatron.algorithms.mastery import MasteryTracker
from mcpo_megatron.config import Config
from mcpo_megatron.parallel.distributed import ParallelInfo
from mcpo_megatron.evaluation.run import check_eval_prompts
from mcpo_megatron.rollout.placement import RolloutPlacement
from mcpo_megatron.trainer.components import (
    build_offload,
    build_policy,
    build_reference,
    build_rollouts,
    build_scorer,
    eval_context,
    resolve_model_dir,
    stop_token_ids,
)
from mcpo_megatron.trainer.partial_schedule import PartialSchedule
from mcpo_megatron.trainer.schedule import GenerationSchedule
from mcpo_megatron.trainer.startup import StartupClock

if TYPE_CHECKING:  # built in build_setup, whose imports are lazy
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from mcpo_megatron.data import PromptRecord, PromptSampler
    from mcpo_megatron.models.policy import MegatronPolicy
    from mcpo_megatron.models.reference import ReferencePolicy
    from mcpo_megatron.rewards import MathVerifyScorer
    from mcpo_megatron.rollout.weights.resharder import Resharder


def load_references(path: str | None) -> dict[str, str]:
    """GCPO golden answers: JSONL lines ``{"uid": ..., "response": ...}`` (already verified offline)."""
    if not path:
        return {}
    refs = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                row = json.loads(line)
                if "uid" not in row or "response" not in row:
                    raise ValueError(f"{path}:{n}: a GCPO reference needs keys 'uid' and 'response'")
                refs[str(row["uid"])] = row["response"]
    return refs


@dataclass
class TrainingSetup:
    """What the loop uses, built once per run."""

    cfg: Config
    info: ParallelInfo
    model_dir: str
    hf_config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase
    records: list[PromptRecord]                  # the training prompts
    prompt_ids: list[list[int]]                  # per record, its prompt's token ids
    uid_to_index: dict[str, int]                 # record uid -> index in records
    sampler: PromptSampler
    tracker: MasteryTracker
    policy: MegatronPolicy
    rollouts: RolloutPlacement                   # LocalRollouts (colocated engines) or RemoteRollouts
    schedule: GenerationSchedule | PartialSchedule  # which prompts, submitted when (PartialSchedule: rollout.partial)
    resharder: Resharder
    scorer: MathVerifyScorer
    stop_token_ids: list[int]
    references: dict[str, list[int]] = field(default_factory=dict)  # GCPO reference answers (token ids per uid)
    ref_policy: ReferencePolicy | None = None                         # algorithm.kl's frozen reference policy
    startup: StartupClock = field(default_factory=StartupClock)       # this rank's start-up, phase by phase

    def evaluate(self, step: int) -> dict[str, float]:
        """Periodic evaluation: flat metrics for the step record; rank 0 also writes the full results (per-problem
        counts, which ``mcpo report`` turns into intervals over problems) to ``<output_dir>/eval/``."""
        from mcpo_megatron.evaluation import write_results
        from mcpo_megatron.evaluation.run import evaluate_benchmarks

        results = evaluate_benchmarks(self.rollouts, self.tokenizer, self.cfg, self.info, self.scorer,
                                      self.stop_token_ids)
        if self.info.rank == 0:
            write_results({f"step_{step}": results}, Path(self.cfg.trainer.output_dir) / "eval")
        out = {}
        for name, res in results.items():
            for key, value in res.summary().items():
                out[f"eval/{name}/{key}"] = value
        return out

    def close(self) -> None:
        self.scorer.close()
        self.rollouts.close()


def build_setup(cfg: Config, info: ParallelInfo, bridge=None, clock: StartupClock | None = None) -> TrainingSetup:
    """Everything the loop uses. With ``rollout.placement=separate`` the engines are on other ranks, reached
    through ``bridge`` (every trainer rank is on it). ``clock``: the start-up's phases so far, continued here."""
    clock = clock or StartupClock()
    from mcpo_megatron.data import PromptSampler, build_prompt_token_ids, load_prompts
    from mcpo_megatron.tools.chat_calls import declared_tools
    from mcpo_megatron.models.sources import load_tokenizer
    from mcpo_megatron.models.multimodal import load_language_model_config
    from mcpo_megatron.rollout.weights.resharder import Resharder

    model_dir = resolve_model_dir(cfg, info)
    hf_config = load_language_model_config(model_dir)
    tokenizer = load_tokenizer(cfg.model.tokenizer or model_dir,
                               remedy="set model.tokenizer to a directory or hub id with the model's tokenizer")
    if cfg.eval.interval and cfg.eval.benchmarks:
        check_eval_prompts(cfg, tokenizer, *eval_context(cfg, hf_config))
    d = cfg.data
    records, report = load_prompts(d.train, path=d.train_path, split="train", num_samples=d.num_train_samples,
                                   seed=d.seed, template=d.prompt_template)
    if info.rank == 0:
        print(f"[data] {d.train}: {report}", flush=True)
    tools = declared_tools(cfg.tools)
    prompt_ids = [build_prompt_token_ids(tokenizer, rec, apply_chat_template=d.apply_chat_template,
                                         max_prompt_length=d.max_prompt_length, tools=tools) for rec in records]
    sampler = PromptSampler(len(records), d.train_batch_size, seed=d.seed, shuffle=d.shuffle)
    clock.mark("tokenizer and prompts")
    policy = build_policy(cfg, model_dir, info, hf_config)
    clock.mark("policy")  # the model built, its weights loaded, the optimizer
    ref_policy = build_reference(cfg, model_dir, info, hf_config) if cfg.algorithm.kl.enable else None
    if ref_policy is not None:
        clock.mark("reference")
    offload = build_offload(cfg, info, policy, ref_policy)
    rollouts = build_rollouts(cfg, model_dir, hf_config, tokenizer, info, bridge, offload=offload, policy=policy)
    clock.mark("engine")
    resharder = Resharder(policy.model_chunks, hf_config, bucket_mb=cfg.reshard.bucket_mb, parallel_info=info)
    scorer = build_scorer(cfg)  # its workers import math-verify in the background
    eos = stop_token_ids(hf_config, tokenizer)
    schedule = (PartialSchedule if cfg.rollout.partial.enable else GenerationSchedule)(
        rollouts, sampler, prompt_ids, cfg, eos)
    references = {}
    if cfg.algorithm.gcpo.enable:
        for uid, text in load_references(cfg.algorithm.gcpo.references).items():
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            references[uid] = ids + eos[:1]
    return TrainingSetup(cfg=cfg, info=info, model_dir=model_dir, hf_config=hf_config, tokenizer=tokenizer,
                         records=records, prompt_ids=prompt_ids,
                         uid_to_index={rec.uid: i for i, rec in enumerate(records)}, sampler=sampler,
                         tracker=MasteryTracker(), policy=policy, rollouts=rollouts, schedule=schedule,
                         resharder=resharder,
                         scorer=scorer, stop_token_ids=eos, references=references, ref_policy=ref_policy,
                         startup=clock)
