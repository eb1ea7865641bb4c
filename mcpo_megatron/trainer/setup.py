"""Builds what the training loop uses: model files, tokenizer, prompts, sampler, policy, engine, resharder,
reward scorer (the components themselves come from components.py). Kept apart from ``loop.py`` so the loop reads
as the algorithm, not as plumbing."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mcpo_megatron.algorithms import gcpo
from mcpo_megatron.algorithms.mastery import MasteryTracker
from mcpo_megatron.config import Config
from mcpo_megatron.parallel.distributed import ParallelInfo
from mcpo_megatron.evaluation.run import check_eval_prompts
from mcpo_megatron.rewards.distributed import DistributedScorer
from mcpo_megatron.rollout.engine import RolloutOutput
from mcpo_megatron.trainer.components import (
    build_policy,
    build_reference,
    build_rollouts,
    build_scorer,
    eval_context,
    resolve_model_dir,
    stop_token_ids,
)
from mcpo_megatron.trainer.schedule import GenerationSchedule
from mcpo_megatron.trainer.step_data import Rollouts


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
    cfg: Config
    info: ParallelInfo
    model_dir: str
    hf_config: Any
    tokenizer: Any
    records: list
    prompt_ids: list[list[int]]
    uid_to_index: dict[str, int]
    sampler: Any
    tracker: MasteryTracker
    policy: Any
    rollouts: Any                                # LocalRollouts (colocated engines) or RemoteRollouts
    schedule: Any                                # GenerationSchedule: which prompts, submitted when
    resharder: Any
    scorer: Any
    stop_token_ids: list[int]
    references: dict[str, list[int]] = field(default_factory=dict)  # GCPO reference answers
    ref_policy: Any = None                                            # algorithm.kl's frozen reference policy

    def score(self, prompt_idx: list[int], out: RolloutOutput, n: int, *, version: int = 0) -> Rollouts:
        """Score every response (each rank verifies a contiguous slice; results are gathered); ``version`` is the
        policy version that generated them."""
        texts = self.tokenizer.batch_decode(out.token_ids, skip_special_tokens=True)
        golds = [self.records[prompt_idx[s.prompt_index]].ground_truth for s in out.samples]
        truncated = [f == "length" for f in out.finish_reasons]
        results = DistributedScorer(self.scorer, self.info.rank, self.info.world_size).score(texts, golds, truncated)
        return Rollouts(
            group_size=n,
            uids=[self.records[i].uid for i in prompt_idx],
            prompt_ids=[self.prompt_ids[i] for i in prompt_idx],
            response_ids=[list(t) for t in out.token_ids],
            rollout_logp=[list(lp) for lp in out.logprobs],
            finish_reasons=list(out.finish_reasons),
            scores=torch.tensor([r.score for r in results], dtype=torch.float64),
            correct=torch.tensor([float(r.correct) for r in results], dtype=torch.float64),
            statuses=[r.status for r in results],
            gcpo_injected=torch.zeros(len(results), dtype=torch.bool),
            routed_experts=out.routed_experts,
            routing_ranks=out.routing_ranks,
            versions=torch.full((len(results),), int(version), dtype=torch.long),
        )

    def inject_references(self, r: Rollouts) -> Rollouts:
        """GCPO: a verified reference answer replaces the lowest-reward rollout of each all-wrong group."""
        refs = [self.references.get(uid) for uid in r.uids]
        inj = gcpo.inject_reference(r.scores, r.correct, r.group_size, r.response_ids, refs,
                                    max_len=self.cfg.data.max_response_length,
                                    reference_reward=self.cfg.reward.correct_score)
        injected = torch.zeros(r.num_samples, dtype=torch.bool)
        finish, statuses, logp = list(r.finish_reasons), list(r.statuses), list(r.rollout_logp)
        for i in inj.replaced:
            injected[i] = True
            finish[i], statuses[i] = "stop", "ok"
            logp[i] = [0.0] * len(inj.responses[i])  # replaced by the trainer's log-probs before use
        # a reference answer was not run by the engine: no routing to replay
        routed = None if r.routed_experts is None else [
            None if bool(injected[i]) else x for i, x in enumerate(r.routed_experts)]
        routing_ranks = None if r.routing_ranks is None else [
            -1 if bool(injected[i]) else x for i, x in enumerate(r.routing_ranks)]
        return Rollouts(group_size=r.group_size, uids=r.uids, prompt_ids=r.prompt_ids,
                        response_ids=[list(x) for x in inj.responses], rollout_logp=logp, finish_reasons=finish,
                        scores=inj.rewards, correct=inj.correct, statuses=statuses, gcpo_injected=injected,
                        routed_experts=routed, routing_ranks=routing_ranks, versions=r.versions)

    def evaluate(self, step: int) -> dict[str, float]:
        """Periodic evaluation: flat metrics for the step record; rank 0 also writes the full results (per-problem
        counts, which ``mcpo report`` turns into intervals over problems) to ``<output_dir>/eval/``."""
        from mcpo_megatron.evaluation import write_results
        from mcpo_megatron.evaluation.run import evaluate_benchmarks

        results = evaluate_benchmarks(self.rollouts, self.tokenizer, self.cfg, self.info, self.scorer,
                                      self.stop_token_ids, num_samples=self.cfg.eval.num_problems)
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


def build_setup(cfg: Config, info: ParallelInfo, bridge=None) -> TrainingSetup:
    """Everything the loop uses. With ``rollout.placement=separate`` the engines are on other ranks, reached
    through ``bridge`` (the trainer leader's; None on the other trainer ranks)."""
    from transformers import AutoConfig

    from mcpo_megatron.data import PromptSampler, build_prompt_token_ids, load_prompts
    from mcpo_megatron.models.sources import load_tokenizer
    from mcpo_megatron.rollout.reshard import Resharder

    model_dir = resolve_model_dir(cfg, info)
    hf_config = AutoConfig.from_pretrained(model_dir)
    tokenizer = load_tokenizer(cfg.model.tokenizer or model_dir,
                               remedy="set model.tokenizer to a directory or hub id with the model's tokenizer")
    if cfg.eval.interval and cfg.eval.benchmarks:
        check_eval_prompts(cfg, tokenizer, *eval_context(cfg, hf_config))
    d = cfg.data
    records, report = load_prompts(d.train, path=d.train_path, split="train", num_samples=d.num_train_samples,
                                   seed=d.seed, template=d.prompt_template)
    if info.rank == 0:
        print(f"[data] {d.train}: {report}", flush=True)
    prompt_ids = [build_prompt_token_ids(tokenizer, rec, apply_chat_template=d.apply_chat_template,
                                         max_prompt_length=d.max_prompt_length) for rec in records]
    sampler = PromptSampler(len(records), d.train_batch_size, seed=d.seed, shuffle=d.shuffle)
    policy = build_policy(cfg, model_dir, info, hf_config)
    ref_policy = build_reference(cfg, model_dir, info, hf_config) if cfg.algorithm.kl.enable else None
    rollouts = build_rollouts(cfg, model_dir, hf_config, tokenizer, info, bridge)
    resharder = Resharder(policy.model_chunks, hf_config, bucket_mb=cfg.reshard.bucket_mb, parallel_info=info)
    scorer = build_scorer(cfg)
    eos = stop_token_ids(hf_config, tokenizer)
    schedule = GenerationSchedule(rollouts, sampler, prompt_ids, cfg, eos)
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
                         scorer=scorer, stop_token_ids=eos, references=references, ref_policy=ref_policy)
