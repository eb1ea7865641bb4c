"""One global step's data, from rollouts to the per-rank ``SequenceBatch`` es, and what the step produced.

Generated samples -> scored :class:`Rollouts` (GCPO references injected) -> shaped rewards -> advantages -> group
filters -> mini-batches -> data-parallel shares -> global per-token loss weights. Every rank computes the same
global view (the rollouts and rewards are gathered to all ranks), so only scoring (each rank verifies a slice) and
:func:`fetch_routing` are collective. :class:`Generation` and :class:`StepOutcome` are what the phases of a step
hand each other and the step's record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from mcpo_megatron.algorithms import advantages as adv_lib
from mcpo_megatron.algorithms import gcpo, losses, sampling, shaping
from mcpo_megatron.algorithms.mastery import GroupStats
from mcpo_megatron.models.batch import SequenceBatch
from mcpo_megatron.models.routing_replay import FETCH_CHUNK
from mcpo_megatron.rewards.distributed import DistributedScorer
from mcpo_megatron.rollout.engines.interface import RolloutOutput
from mcpo_megatron.rollout.placement import GeneratedBatch
from mcpo_megatron.rollout.weights.resharder import ReshardStats

if TYPE_CHECKING:
    from mcpo_megatron.trainer.setup import TrainingSetup


@dataclass
class Rollouts:
    """Rollouts of a set of prompt groups, laid out group after group (G samples per group)."""

    group_size: int
    uids: list[str]                      # per group
    prompt_ids: list[list[int]]          # per group
    response_ids: list[list[int]]        # per sample
    rollout_logp: list[list[float]]      # per sample, the engine's processed log-probs
    finish_reasons: list[str]            # per sample: stop | length
    scores: torch.Tensor                 # [N] verifier score (+1 / -1 convention)
    correct: torch.Tensor                # [N] 0/1 from the verifier, never shaped
    statuses: list[str]                  # per sample: ok | no_answer | timeout | crashed
    gcpo_injected: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))
    # per sample, the engine's routing (RolloutSample.routed_experts; None for a sample it never ran), or None
    routed_experts: list | None = None
    # per sample, the rank holding its routing when routing stays where it was generated (fetch_routing), else None
    routing_ranks: list[int] | None = None
    # [N] per sample, the policy version (global steps trained) of the engine weights that generated it; with partial
    # rollouts the version of its oldest token
    versions: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    # per sample, the version that sampled each token (partial rollouts), or None when one version made each sample
    token_versions: list[list[int]] | None = None
    # per sample, True on the tokens the engine sampled and False on an episode's tool outputs (rollout/episodes.py),
    # or None when every token of every sample was sampled
    model_masks: list[list[bool]] | None = None
    # [N] per sample, the episode's tool calls that failed by the code's doing (tools.call_penalty); empty without tools
    tool_failures: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    @property
    def num_groups(self) -> int:
        return len(self.uids)

    @property
    def num_samples(self) -> int:
        return len(self.response_ids)

    def response_lengths(self) -> torch.Tensor:
        return torch.tensor([len(r) for r in self.response_ids], dtype=torch.long)

    def truncated(self) -> torch.Tensor:
        return torch.tensor([f == "length" for f in self.finish_reasons], dtype=torch.bool)

    def select_groups(self, groups: Sequence[int]) -> "Rollouts":
        g = self.group_size
        samples = [gi * g + j for gi in groups for j in range(g)]
        idx = torch.tensor(samples, dtype=torch.long)
        injected = self.gcpo_injected[idx] if self.gcpo_injected.numel() else self.gcpo_injected
        return Rollouts(
            group_size=g,
            uids=[self.uids[i] for i in groups],
            prompt_ids=[self.prompt_ids[i] for i in groups],
            response_ids=[self.response_ids[i] for i in samples],
            rollout_logp=[self.rollout_logp[i] for i in samples],
            finish_reasons=[self.finish_reasons[i] for i in samples],
            scores=self.scores[idx], correct=self.correct[idx],
            statuses=[self.statuses[i] for i in samples], gcpo_injected=injected,
            routed_experts=None if self.routed_experts is None else [self.routed_experts[i] for i in samples],
            routing_ranks=None if self.routing_ranks is None else [self.routing_ranks[i] for i in samples],
            versions=self.versions[idx] if self.versions.numel() else self.versions,
            token_versions=None if self.token_versions is None else [self.token_versions[i] for i in samples],
            model_masks=None if self.model_masks is None else [self.model_masks[i] for i in samples],
            tool_failures=self.tool_failures[idx] if self.tool_failures.numel() else self.tool_failures,
        )

    def per_token_model_masks(self) -> list[list[bool]]:
        """Per sample, whether the engine sampled each token (all True without tool outputs)."""
        if self.model_masks is not None:
            return self.model_masks
        return [[True] * len(r) for r in self.response_ids]

    def model_token_lengths(self) -> torch.Tensor:
        """[N] long: the tokens of each response the engine sampled (an episode's tool outputs left out)."""
        if self.model_masks is None:
            return self.response_lengths()
        return torch.tensor([sum(m) for m in self.model_masks], dtype=torch.long)

    def per_token_versions(self) -> list[list[int]]:
        """The version of every token of every sample (each sample's own version where one made it whole)."""
        if self.token_versions is not None:
            return self.token_versions
        return [[int(v)] * len(r) for v, r in zip(self.versions.tolist(), self.response_ids)]

    @staticmethod
    def concat(parts: Sequence["Rollouts"]) -> "Rollouts":
        first = parts[0]
        return Rollouts(
            group_size=first.group_size,
            uids=[u for p in parts for u in p.uids],
            prompt_ids=[x for p in parts for x in p.prompt_ids],
            response_ids=[x for p in parts for x in p.response_ids],
            rollout_logp=[x for p in parts for x in p.rollout_logp],
            finish_reasons=[x for p in parts for x in p.finish_reasons],
            scores=torch.cat([p.scores for p in parts]), correct=torch.cat([p.correct for p in parts]),
            statuses=[x for p in parts for x in p.statuses],
            gcpo_injected=torch.cat([p.gcpo_injected for p in parts]),
            routed_experts=None if any(p.routed_experts is None for p in parts)
            else [x for p in parts for x in p.routed_experts],
            routing_ranks=None if any(p.routing_ranks is None for p in parts)
            else [x for p in parts for x in p.routing_ranks],
            versions=torch.cat([p.versions for p in parts]),
            token_versions=None if all(p.token_versions is None for p in parts)
            else [x for p in parts for x in p.per_token_versions()],
            model_masks=None if all(p.model_masks is None for p in parts)
            else [x for p in parts for x in p.per_token_model_masks()],
            tool_failures=torch.cat([p.per_sample_tool_failures() for p in parts]),
        )

    def per_sample_tool_failures(self) -> torch.Tensor:
        """[N] long: each sample's failed tool calls (zeros without tools)."""
        if self.tool_failures.numel():
            return self.tool_failures
        return torch.zeros(self.num_samples, dtype=torch.long)


def score(s: TrainingSetup, prompt_idx: list[int], out: RolloutOutput, n: int, *, version: int = 0) -> Rollouts:
    """The generated ``out`` (``n`` samples for each prompt of ``prompt_idx``) as rollouts, every response scored
    (each rank verifies a contiguous slice; results are gathered); ``version`` is the policy version that
    generated them, unless the samples carry the version of each token (partial rollouts)."""
    texts = s.tokenizer.batch_decode(out.token_ids, skip_special_tokens=True)
    golds = [s.records[prompt_idx[x.prompt_index]].ground_truth for x in out.samples]
    truncated = [f == "length" for f in out.finish_reasons]
    results = DistributedScorer(s.scorer, s.info.rank, s.info.world_size).score(texts, golds, truncated)
    token_versions = None
    if any(x.versions is not None for x in out.samples):
        token_versions = [list(x.versions) if x.versions is not None else [int(version)] * len(x.token_ids)
                          for x in out.samples]
    versions = ([min(v) if v else int(version) for v in token_versions] if token_versions is not None
                else [int(version)] * len(results))
    model_masks = None
    if any(x.model_mask is not None and not all(x.model_mask) for x in out.samples):
        model_masks = [list(x.model_mask) if x.model_mask is not None else [True] * len(x.token_ids)
                       for x in out.samples]
    return Rollouts(
        group_size=n,
        uids=[s.records[i].uid for i in prompt_idx],
        prompt_ids=[s.prompt_ids[i] for i in prompt_idx],
        response_ids=[list(t) for t in out.token_ids],
        rollout_logp=[list(lp) for lp in out.logprobs],
        finish_reasons=list(out.finish_reasons),
        scores=torch.tensor([r.score for r in results], dtype=torch.float64),
        correct=torch.tensor([float(r.correct) for r in results], dtype=torch.float64),
        statuses=[r.status for r in results],
        gcpo_injected=torch.zeros(len(results), dtype=torch.bool),
        routed_experts=out.routed_experts,
        routing_ranks=out.routing_ranks,
        versions=torch.tensor(versions, dtype=torch.long), token_versions=token_versions, model_masks=model_masks,
        tool_failures=torch.tensor([x.episode.failures if x.episode is not None else 0 for x in out.samples],
                                   dtype=torch.long) if any(x.episode is not None for x in out.samples)
        else torch.zeros(0, dtype=torch.long),
    )


def inject_references(r: Rollouts, references: dict[str, list[int]], cfg) -> Rollouts:
    """GCPO: a verified reference answer (token ids per prompt uid) replaces the lowest-reward rollout of each
    all-wrong group."""
    refs = [references.get(uid) for uid in r.uids]
    inj = gcpo.inject_reference(r.scores, r.correct, r.group_size, r.response_ids, refs,
                                max_len=cfg.data.max_response_length, reference_reward=cfg.reward.correct_score)
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
    # a reference answer was not sampled: its tokens are counted at the version of the sample it replaces
    token_versions = None if r.token_versions is None else [
        [int(r.versions[i])] * len(inj.responses[i]) if bool(injected[i]) else v
        for i, v in enumerate(r.token_versions)]
    # a reference answer is text to train on, all of it (no tool output in it)
    model_masks = None if r.model_masks is None else [
        [True] * len(inj.responses[i]) if bool(injected[i]) else m for i, m in enumerate(r.model_masks)]
    return Rollouts(group_size=r.group_size, uids=r.uids, prompt_ids=r.prompt_ids,
                    response_ids=[list(x) for x in inj.responses], rollout_logp=logp, finish_reasons=finish,
                    scores=inj.rewards, correct=inj.correct, statuses=statuses, gcpo_injected=injected,
                    routed_experts=routed, routing_ranks=routing_ranks, versions=r.versions,
                    token_versions=token_versions, model_masks=model_masks,
                    tool_failures=r.tool_failures.masked_fill(injected, 0) if r.tool_failures.numel()
                    else r.tool_failures)


@dataclass
class Generation:
    """A step's generation beyond the rollouts it trains on: every batch it generated (dynamic sampling draws
    more than it keeps; samples too stale are dropped), for the step's record and mastery tracking."""

    batches: list[GeneratedBatch]       # every generation batch of the step, as the placement returned it
    seen: Rollouts                      # every sample generated, scored (without routing: outcomes only)
    seen_stats: GroupStats              # the mastery statistics of their groups
    stale_samples: int                  # generated more than trainer.max_staleness versions ago: never trained on
    filter_counts: dict[str, int]       # dynamic sampling's counts of groups (empty without it)
    warnings: list[str]                 # for the log: a partial batch, stale samples dropped
    retention_probe: list[float] | None = None  # per probe sample, 0/1 correct (diagnostics.retention_probe)

    @property
    def num_batches(self) -> int:
        return len(self.batches)


def shaped_rewards(r: Rollouts, cfg) -> torch.Tensor:
    """Verifier score plus DAPO's soft overlong penalty when enabled (docs/algorithms.md §9), minus
    ``tools.call_penalty`` per tool call of the reply that failed by its code's doing (§16)."""
    rewards = r.scores.double()
    if cfg.tools.call_penalty and r.tool_failures.numel():
        rewards = rewards - float(cfg.tools.call_penalty) * r.tool_failures.double()
    ob = cfg.reward.overlong_buffer
    if ob.enable:
        rewards = rewards + shaping.overlong_penalty(r.response_lengths(), cfg.data.max_response_length,
                                                     ob.len, ob.penalty_factor).double()
    return rewards


def estimator_name(cfg) -> str:
    """The advantage estimator of ``algorithms.advantages``: MCPO reweighting is GRPO with scale(p)."""
    if cfg.algorithm.adv_estimator == "grpo" and cfg.algorithm.mcpo.reweight:
        return "mcpo"
    return cfg.algorithm.adv_estimator


def compute_advantages(r: Rollouts, rewards: torch.Tensor, cfg) -> torch.Tensor:
    a = cfg.algorithm
    return adv_lib.group_advantages(rewards, r.correct.double(), r.group_size, estimator=estimator_name(cfg),
                                    std_mode=a.std_mode, eps=a.eps, threshold=a.mcpo.threshold)


def dynamic_sampling_keep(r: Rollouts) -> tuple[list[int], dict]:
    """DAPO filter: the groups whose verifier accuracy varies (neither all-correct nor all-wrong)."""
    keep_mask, counts = sampling.dynamic_sampling_filter(r.correct.double(), r.group_size)
    return [i for i, k in enumerate(keep_mask.tolist()) if k], counts


def minibatch_groups(num_groups: int, num_minibatches: int) -> list[list[int]]:
    """Contiguous, near-equal split of the step's groups into optimizer mini-batches."""
    num_minibatches = max(1, min(num_minibatches, num_groups))
    bounds = [round(i * num_groups / num_minibatches) for i in range(num_minibatches + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(num_minibatches)]


def assign_to_ranks(lengths: Sequence[int], dp_size: int) -> list[list[int]]:
    """Deterministic token balancing: longest sequence first, to the least-loaded data-parallel rank."""
    loads = [0] * dp_size
    shares: list[list[int]] = [[] for _ in range(dp_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(dp_size), key=lambda k: (loads[k], k))
        shares[r].append(i)
        loads[r] += lengths[i]
    return [sorted(s) for s in shares]


@dataclass
class StepPlan:
    """Everything the optimizer steps of one global step need, for this rank."""

    minibatches: list[SequenceBatch]         # this DP rank's share of each mini-batch (with global weights)
    global_counts: list[torch.Tensor]        # per mini-batch: (tokens, sequences, mastered sequences)
    mastered: torch.Tensor                   # [N] bool per sample of the step
    advantages: torch.Tensor                 # [N]
    rewards: torch.Tensor                    # [N]
    local_samples: list[list[int]]           # per mini-batch: step-sample indices of this rank's share


def fetch_routing(r: Rollouts, needed: Sequence[int], rank: int, *, chunk: int = FETCH_CHUNK) -> None:
    """R3 with each rank holding only the routing its rollout replica generated (``routing_ranks``): every
    rank receives the routing of the samples in ``needed`` (its data-parallel share, :func:`dp_shares`) and
    drops the rest. A rank's host memory then peaks at the larger of its replica's routing (which the
    replica's first rank sends) and its share plus one chunk, instead of the whole step's routing on every
    rank. Collective over the default group: each holder broadcasts its samples' routing in chunks of
    ``chunk`` samples (pickled host tensors: the group's CPU backend, or staged through its device by
    broadcast_object)."""
    if r.routing_ranks is None or r.routed_experts is None:
        return
    from mcpo_megatron.parallel.distributed import broadcast_object

    wanted = set(needed)
    routes, holders = r.routed_experts, r.routing_ranks
    for i in range(r.num_samples):  # what this rank neither trains nor sends
        if i not in wanted and holders[i] != rank:
            routes[i] = None
    for holder in sorted({h for h in holders if h >= 0}):
        held = [i for i, h in enumerate(holders) if h == holder]
        for start in range(0, len(held), chunk):
            part = held[start:start + chunk]
            sent = broadcast_object({i: routes[i] for i in part} if rank == holder else None, src=holder)
            for i in part:
                routes[i] = sent[i] if i in wanted else None
    r.routing_ranks = None  # the routing of every sample this rank trains is here now


def dp_shares(r: Rollouts, cfg, dp_size: int) -> list[list[int]]:
    """Per data-parallel rank, the step's samples it trains over all mini-batches (as :func:`plan_step`
    assigns them; a rank without a sequence trains a zero-weight copy of the mini-batch's first sample)."""
    shares: list[list[int]] = [[] for _ in range(dp_size)]
    for samples, assignment in _minibatch_assignments(r, cfg, dp_size):
        for rank, share in enumerate(assignment):
            shares[rank] += [samples[i] for i in share] if share else [samples[0]]
    return shares


def _minibatch_assignments(r: Rollouts, cfg, dp_size: int):
    """Per mini-batch: its samples, and per DP rank the positions (in those samples) of the rank's share."""
    g = r.group_size
    lengths = r.response_lengths()
    for groups in minibatch_groups(r.num_groups, max(1, cfg.data.train_batch_size // cfg.algorithm.mini_batch_size)):
        samples = [gi * g + j for gi in groups for j in range(g)]
        seq_lens = [len(r.prompt_ids[s // g]) + int(lengths[s]) for s in samples]
        yield samples, rank_shares(seq_lens, dp_size, cfg)


def rank_shares(seq_lens: Sequence[int], dp_size: int, cfg) -> list[list[int]]:
    """Per data-parallel rank, the positions of its sequences: with ``trainer.sequence_packing``, Karmarkar-Karp
    over each sequence's cost (tokens or estimated FLOPs, ``trainer.packing_balance``), else
    :func:`assign_to_ranks`."""
    if not cfg.trainer.sequence_packing:
        return assign_to_ranks(seq_lens, dp_size)
    from mcpo_megatron.models.packing import balanced_partition, sequence_cost

    return balanced_partition([sequence_cost(n, cfg.trainer.packing_balance) for n in seq_lens], dp_size)


def plan_step(r: Rollouts, advantages: torch.Tensor, rewards: torch.Tensor, mastered_groups: torch.Tensor, cfg,
              *, dp_rank: int, dp_size: int) -> StepPlan:
    """Split the step into mini-batches and DP shares, with per-token weights from global counts.

    Weights follow ``losses.token_weights`` with counts over the whole mini-batch (all DP ranks), so the
    sum of every rank's micro-batch losses is exactly the mini-batch loss of docs/algorithms.md §4.
    """
    masks = r.per_token_model_masks()  # an episode's tool outputs count in no loss denominator
    mastered = mastered_groups.repeat_interleave(r.group_size)
    plan = StepPlan([], [], mastered, advantages, rewards, [])
    for samples, assignment in _minibatch_assignments(r, cfg, dp_size):
        resp_mask = [torch.tensor(masks[s], dtype=torch.bool) for s in samples]
        counts = torch.stack([losses.local_counts(m.unsqueeze(0), mastered[s].view(1))
                              for m, s in zip(resp_mask, samples)]).sum(0)
        share = assignment[dp_rank]
        if not share:  # more DP ranks than sequences: train a zero-weight copy so every rank steps
            share, zero_weight = [0], True
        else:
            zero_weight = False
        local = [samples[i] for i in share]
        plan.minibatches.append(_sequence_batch(r, local, advantages, mastered, counts, cfg, zero_weight))
        plan.global_counts.append(counts)
        plan.local_samples.append([] if zero_weight else local)
    return plan


def _sequence_batch(r: Rollouts, samples: list[int], advantages: torch.Tensor, mastered: torch.Tensor,
                    counts: torch.Tensor, cfg, zero_weight: bool) -> SequenceBatch:
    g = r.group_size
    a = cfg.algorithm
    input_ids, prompt_lens, resp_lens = [], [], []
    fields: dict[str, list[torch.Tensor]] = {"advantages": [], "rollout_logp": [], "pg_weight": [], "hkl_weight": []}
    if r.model_masks is not None:
        fields["model_mask"] = []  # 1 on the engine's tokens, 0 on tool outputs: the loss's mask (loop.make_loss_fn)
    for s in samples:
        prompt, resp = r.prompt_ids[s // g], r.response_ids[s]
        input_ids.append(torch.tensor(prompt + resp, dtype=torch.long))
        prompt_lens.append(len(prompt))
        resp_lens.append(len(resp))
        if r.model_masks is None:
            mask = torch.ones(1, len(resp), dtype=torch.bool)
        else:
            mask = torch.tensor(r.model_masks[s], dtype=torch.bool).view(1, -1)
            fields["model_mask"].append(mask[0].float())
        pg_w, hkl_w = losses.token_weights(
            mask, mastered[s].view(1), loss_agg_mode=a.loss_agg_mode, global_counts=counts,
            max_response_length=cfg.data.max_response_length, hinge_agg=a.mcpo.hinge_kl.agg)
        if zero_weight:
            pg_w, hkl_w = torch.zeros_like(pg_w), torch.zeros_like(hkl_w)
        fields["pg_weight"].append(pg_w[0].float())
        fields["hkl_weight"].append(hkl_w[0].float())
        fields["advantages"].append(torch.full((len(resp),), float(advantages[s])))
        fields["rollout_logp"].append(torch.tensor(r.rollout_logp[s], dtype=torch.float32))
    return SequenceBatch(
        input_ids=input_ids, prompt_lens=torch.tensor(prompt_lens, dtype=torch.long),
        response_lens=torch.tensor(resp_lens, dtype=torch.long), token_fields=fields,
        seq_fields={"mastered": mastered[samples].clone(), "sample_index": torch.tensor(samples)},
        routing=None if r.routed_experts is None else [engine_routing(r.routed_experts[s]) for s in samples],
    )


def engine_routing(routed: torch.Tensor | None) -> torch.Tensor:
    """A sample's engine routing as a replay record (a sample the engine never ran: no token known)."""
    return torch.zeros(0, 0, 0, dtype=torch.int16) if routed is None else torch.as_tensor(routed)


def anchor_injected_references(plan: StepPlan, r: Rollouts) -> None:
    """A GCPO reference answer was never sampled by the engine: use the trainer's log-probs as its
    rollout log-probs, so truncated importance sampling gives it weight 1 (docs/algorithms.md §8, §10)."""
    if not r.gcpo_injected.numel() or not bool(r.gcpo_injected.any()):
        return
    for mb, local in zip(plan.minibatches, plan.local_samples):
        for j, sample in enumerate(local):
            if bool(r.gcpo_injected[sample]):
                mb.token_fields["rollout_logp"][j] = mb.token_fields["old_logp"][j].clone()


def mask_off_policy_tokens(plan: StepPlan, r: Rollouts, settings) -> None:
    """The token and sequence masks of docs/algorithms.md §8 (``algorithms.off_policy``, from the trainer's old
    log-probs and the engine's) into each mini-batch's ``behaviour_mask`` token field; nothing when both are off.
    A GCPO reference answer was not sampled: it is never masked."""
    if not settings.enabled:
        return
    from mcpo_megatron.algorithms.off_policy import behaviour_mask

    for mb, local in zip(plan.minibatches, plan.local_samples):
        f = mb.token_fields
        f["behaviour_mask"] = [
            torch.ones_like(old) if j >= len(local) or bool(r.gcpo_injected[local[j]])
            else _on_model_tokens(lambda o, ro: behaviour_mask(o, ro, settings), old, roll, model_tokens(mb, j))
            for j, (old, roll) in enumerate(zip(f["old_logp"], f["rollout_logp"]))]


def model_tokens(mb: SequenceBatch, j: int) -> torch.Tensor | None:
    """[T] bool: which tokens of sequence ``j`` of ``mb`` the engine sampled; None when all of them were."""
    masks = mb.token_fields.get("model_mask")
    return None if masks is None else masks[j] > 0


def _on_model_tokens(fn, old: torch.Tensor, roll: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """``fn(old, roll)`` on the engine's tokens only (a sequence ratio over them alone), 1 on tool outputs."""
    if keep is None or bool(keep.all()):
        return fn(old, roll)
    out = torch.ones_like(old)
    out[keep] = fn(old[keep], roll[keep]).to(out.dtype)
    return out


@dataclass
class PolicyUpdates:
    """The optimizer steps of one global step: loss metric sums added over them, and each one's grad norm."""

    sums: dict[str, float] = field(default_factory=dict)
    grad_norms: list[float] = field(default_factory=list)
    lr_sum: float = 0.0
    skipped: float = 0.0
    microbatches: float = 0.0
    filler_microbatches: float = 0.0


@dataclass
class StepOutcome:
    """What one global step produced: the input of its metrics record."""

    rollouts: Rollouts               # the samples trained on
    rewards: torch.Tensor            # [N] shaped rewards
    advantages: torch.Tensor         # [N]
    stats: GroupStats                # the mastery statistics of the trained groups
    generation: Generation
    mismatch: dict[str, float]       # engine vs trainer log-probs (metrics.rollout_mismatch)
    updates: PolicyUpdates
    reshard: ReshardStats
