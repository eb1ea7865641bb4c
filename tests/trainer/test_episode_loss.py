"""Episodes with tool outputs in the loss: every algorithm trains the model's tokens only.

The reduction each algorithm must satisfy: a step on episodes whose tool-output tokens are masked gives the same
loss, metric sums and gradient on the model's tokens as the same step with the tool tokens deleted from the
responses (the single-turn case), and no gradient on the tool tokens. It holds for the PG term with token and
sequence ratios (GSPO's ratio over the model's tokens only), MCPO's hinge-KL and reweighting, the reference KL,
the entropy bonus, TIS and the token and sequence masks, under every loss aggregation, and with GCPO's reference
answer in place of an episode.
"""

import pytest
import torch

from mcpo_megatron.algorithms import mastery
from mcpo_megatron.algorithms.off_policy import MaskSettings
from mcpo_megatron.config import load_config
from mcpo_megatron.models.batch import make_microbatch
from mcpo_megatron.trainer import step_data
from mcpo_megatron.trainer.loop import make_loss_fn
from mcpo_megatron.trainer.metrics import off_policy_metrics, rollout_mismatch

# per sample: (model tokens before the call, tool tokens, model tokens after it); 2 groups of 4
SHAPES = [(3, 4, 2), (5, 0, 0), (2, 6, 3), (4, 0, 0), (1, 3, 1), (6, 0, 0), (2, 2, 5), (3, 0, 0)]
CORRECT = [1, 1, 0, 1, 0, 1, 0, 0]


def _episodes(correct=CORRECT):
    """Rollouts with tool outputs, and the same rollouts with them deleted."""
    g = torch.Generator().manual_seed(0)
    resp, logp, masks = [], [], []
    for before, tool, after in SHAPES:
        ids = torch.randint(10, 90, (before + tool + after,), generator=g).tolist()
        lp = (-torch.rand(before + tool + after, generator=g, dtype=torch.float64) * 2).tolist()
        mask = [True] * before + [False] * tool + [True] * after
        resp.append(ids)
        logp.append([x if m else 0.0 for x, m in zip(lp, mask)])  # a tool token has no engine log-prob
        masks.append(mask)
    n = len(SHAPES)
    common = dict(group_size=4, uids=["a", "b"], prompt_ids=[[1, 2, 3], [4, 5]], finish_reasons=["stop"] * n,
                  scores=torch.tensor([1.0 if c else -1.0 for c in correct], dtype=torch.float64),
                  correct=torch.tensor(correct, dtype=torch.float64), statuses=["ok"] * n,
                  gcpo_injected=torch.zeros(n, dtype=torch.bool))
    with_tools = step_data.Rollouts(response_ids=resp, rollout_logp=logp, model_masks=masks, **common)
    keep = lambda xs, m: [x for x, k in zip(xs, m) if k]  # noqa: E731
    deleted = step_data.Rollouts(response_ids=[keep(x, m) for x, m in zip(resp, masks)],
                                 rollout_logp=[keep(x, m) for x, m in zip(logp, masks)], **common)
    return with_tools, deleted


def _token_values(r, seed):
    """Per sample, a value for each token: the same on a model token in both forms, arbitrary on a tool token."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for mask in r.per_token_model_masks():
        model = (-torch.rand(sum(mask), generator=g) * 2).tolist()
        it = iter(model)
        out.append(torch.tensor([next(it) if m else 7.5 for m in mask]))  # 7.5: would move any term it entered
    return out


CASES = {
    "grpo": [], "dapo": ["algorithm.filter_groups.enable=false"], "drgrpo": [], "gspo": [],
    "mcpo": ["algorithm.mini_batch_size=4"],
    "mcpo-token-mean": ["algorithm.loss_agg_mode=token-mean"],
    "grpo+kl+entropy": ["algorithm.kl.enable=true", "algorithm.kl.coef=0.1", "algorithm.entropy_coeff=0.01"],
    "grpo+tis+masks": ["algorithm.tis.enable=true", "algorithm.token_mask.enable=true",
                       "algorithm.token_mask.low=0.5", "algorithm.token_mask.high=2.0",
                       "algorithm.sequence_mask.enable=true", "algorithm.sequence_mask.low=0.6",
                       "algorithm.sequence_mask.high=1.6"],
    "gspo+seq-mask-product": ["algorithm.sequence_mask.enable=true", "algorithm.sequence_mask.ratio=product",
                              "algorithm.sequence_mask.low=0.05", "algorithm.sequence_mask.high=20"],
    # the second group all wrong: GCPO's reference answer replaces an episode with a tool output (sample 4)
    "gcpo": [],
}
ALL_WRONG_B = [1, 1, 0, 1, 0, 0, 0, 0]


@pytest.mark.parametrize("case", list(CASES))
def test_tool_tokens_are_in_no_term(case):
    name = case.split("-")[0].split("+")[0]
    cfg = load_config(None, ["data.train_batch_size=2", "algorithm.mini_batch_size=1", "rollout.n=4",
                             "reward.overlong_buffer.enable=false", "data.max_response_length=16",
                             f"algorithm.name={name}", *CASES[case]])
    results = []
    forms = _episodes()
    if name == "gcpo":
        forms = [step_data.inject_references(r, {"b": [11, 12, 13, 14]}, cfg) for r in _episodes(ALL_WRONG_B)]
        assert all(r.gcpo_injected.tolist() == [False] * 4 + [True] + [False] * 3 for r in forms)
        assert forms[0].per_token_model_masks()[4] == [True] * 4  # the reference is the model's text, all of it
    for r in forms:
        rewards = step_data.shaped_rewards(r, cfg)
        adv = step_data.compute_advantages(r, rewards, cfg)
        stats = mastery.group_stats(r.correct, 4, threshold=cfg.algorithm.mcpo.threshold)
        plan = step_data.plan_step(r, adv, rewards, stats.mastered, cfg, dp_rank=0, dp_size=1)
        old_all, new_all, ref_all, ent_all = (_token_values(r, s) for s in (1, 2, 3, 4))
        for mb, local in zip(plan.minibatches, plan.local_samples):
            mb.token_fields["old_logp"] = [old_all[s] for s in local]
            mb.token_fields["ref_logp"] = [ref_all[s] for s in local]
        masks = MaskSettings.from_config(cfg.algorithm)
        step_data.mask_off_policy_tokens(plan, r, masks)
        info = type("Info", (), {"dp_group": None})()
        metrics = {**rollout_mismatch(plan, r, info), **off_policy_metrics(plan, r, info, masks.sequence_ratio)}
        steps = []
        for mb, local in zip(plan.minibatches, plan.local_samples):
            micro = make_microbatch(mb, list(range(len(local))))
            logp = torch.zeros_like(micro.token_fields["old_logp"])
            entropy = torch.zeros_like(logp)
            for row, s in enumerate(local):
                logp[row, : len(new_all[s])] = new_all[s]
                entropy[row, : len(ent_all[s])] = ent_all[s].abs()
            logp.requires_grad_(True)
            entropy.requires_grad_(True)
            loss, sums = make_loss_fn(cfg)(logp, entropy, micro)
            loss.backward()
            grads = [logp.grad[row, : len(new_all[s])] for row, s in enumerate(local)]
            egrad = entropy.grad if entropy.grad is not None else torch.zeros_like(entropy)  # no entropy bonus
            egrads = [egrad[row, : len(ent_all[s])] for row, s in enumerate(local)]
            steps.append((loss.item(), {k: float(v) for k, v in sums.items()}, grads, egrads, local))
        results.append((steps, metrics, r))
    (tool_steps, tool_metrics, r_tools), (plain_steps, plain_metrics, _) = results
    assert tool_metrics == pytest.approx(plain_metrics, rel=1e-9, abs=1e-12)
    masks = r_tools.per_token_model_masks()
    for (lt, st, gt, et, local), (lp, sp, gp, ep, _) in zip(tool_steps, plain_steps):
        assert lt != 0 or lp == 0
        assert lt == pytest.approx(lp, rel=1e-6, abs=1e-9)
        assert st == pytest.approx(sp, rel=1e-6, abs=1e-9)
        for s, g_tool, g_plain, e_tool, e_plain in zip(local, gt, gp, et, ep):
            keep = torch.tensor(masks[s])
            torch.testing.assert_close(g_tool[keep], g_plain, rtol=1e-6, atol=1e-9)
            torch.testing.assert_close(e_tool[keep], e_plain, rtol=1e-6, atol=1e-9)
            assert g_tool[~keep].abs().max().item() == 0 if (~keep).any() else True
            assert e_tool[~keep].abs().max().item() == 0 if (~keep).any() else True


def test_without_tool_outputs_nothing_changes():
    """An all-model mask is the single-turn case exactly: the same mini-batch fields, bit for bit."""
    with_tools, _ = _episodes()
    plain = step_data.Rollouts(**{**with_tools.__dict__, "model_masks": None})
    all_model = step_data.Rollouts(**{**with_tools.__dict__,
                                      "model_masks": [[True] * len(x) for x in with_tools.response_ids]})
    cfg = load_config(None, ["data.train_batch_size=2", "algorithm.mini_batch_size=1", "rollout.n=4",
                             "reward.overlong_buffer.enable=false"])
    plans = []
    for r in (plain, all_model):
        rewards = step_data.shaped_rewards(r, cfg)
        adv = step_data.compute_advantages(r, rewards, cfg)
        plans.append(step_data.plan_step(r, adv, rewards, mastery.group_stats(r.correct, 4).mastered, cfg,
                                         dp_rank=0, dp_size=1))
    for a, b in zip(plans[0].minibatches, plans[1].minibatches):
        for key in a.token_fields:
            for x, y in zip(a.token_fields[key], b.token_fields[key]):
                assert torch.equal(x, y), key
        assert all(torch.equal(m, torch.ones_like(m)) for m in b.token_fields["model_mask"])


def test_call_penalty_counts_the_codes_failures():
    r, _ = _episodes()
    r.tool_failures = torch.tensor([0, 0, 2, 0, 1, 0, 0, 0])
    cfg = load_config(None, ["data.train_batch_size=2", "algorithm.mini_batch_size=1", "rollout.n=4",
                             "reward.overlong_buffer.enable=false", "tools.call_penalty=0.25"])
    torch.testing.assert_close(step_data.shaped_rewards(r, cfg),
                               r.scores - 0.25 * torch.tensor([0, 0, 2, 0, 1, 0, 0, 0], dtype=torch.float64))
    kept = r.select_groups([1])
    assert kept.tool_failures.tolist() == [1, 0, 0, 0]
    joined = step_data.Rollouts.concat([r.select_groups([0]), step_data.Rollouts(**{**kept.__dict__,
                                                                                    "tool_failures": torch.zeros(0, dtype=torch.long)})])
    assert joined.tool_failures.tolist() == [0, 0, 2, 0, 0, 0, 0, 0]
