"""The training phase and the old log-probs against a plain PyTorch trainer, side by side in one run.

One global step of the embedded job (configs/cpu_smollm2_arith.yaml: its optimizer, loss, micro-batch budget and
log-prob chunk; ``--samples`` responses of ``--prompt-len`` + ``--response-len`` tokens, ``--mini-batches``
optimizer steps, the MCPO loss with its token weights and hinge-KL on a quarter of the responses), from the same
weights, run by:

- the project as the job runs it: ``MegatronPolicy.train_step`` per mini-batch with the trainer's settings
  (``trainer/components.policy_settings``) and loss (``trainer/loop.make_loss_fn``): megatron-core's DDP and
  distributed optimizer, the vocab-parallel log-probs; and ``compute_logprobs`` for the old log-probs; at
  ``--tp`` x DP = world / TP;
- the reference written here: the transformers model, ``torch.nn.parallel.DistributedDataParallel`` over the
  same process group when there is more than one rank (DP = world size: at TP > 1 it is the plain trainer on the
  same processes and cores), forward, ``log_softmax`` over the full vocabulary and a gather, the same loss
  (``policy_loss`` with the job's settings), backward, ``clip_grad_norm_`` and ``torch.optim.AdamW`` with the job's
  optimizer settings; and a plain no-grad forward for the old log-probs.

The two run in turn within each timed step (``--order interleaved``), so that both see the same machine; or one
after the other (``--order sequential``: the project's model is freed before the reference is built, for shapes
whose two copies do not fit in memory together).

Breakdown of the training phase, in seconds per global step (medians over the timed steps, the slowest rank):
forward (the model's forward pass; the project's includes waiting for its parameter all-gather), log-probs and
loss (the project: ``_response_logprobs`` and the loss; the reference: ``log_softmax``, gather, loss), backward
(the reference's includes DDP's gradient all-reduce, which it overlaps with the backward pass), gradient
reduction (the project: ``finalize_model_grads``, its reduce-scatter), optimizer (the project:
``optimizer.step``, clipping and the parameter all-gather included; the reference: clip, step, zero), and the rest
(micro-batch making, host work, metric reductions). The project computes each token's entropy in training, for
its metric; the reference does not.

Run under torchrun: ``torchrun --nproc_per_node 2 bench/bench_vs_plain.py --tp 2`` (or ``--tp 1`` for DP=2), or
as one process for TP=1 DP=1. ``--model qwen3-0.6b`` is Qwen3-0.6B's shape with random weights (28 layers,
hidden 1024, 16/8 heads of 128, FFN 3072, vocabulary 151,936, tied); ``--layers`` shortens it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from machine import describe  # noqa: E402

JOB = Path(__file__).resolve().parents[1] / "configs" / "cpu_smollm2_arith.yaml"
LOSS_FIELDS = ("old_logp", "pg_weight", "hkl_weight", "advantage")
PHASES = ("forward", "logprobs+loss", "backward", "grad reduction", "optimizer", "rest")
QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                  max_position_embeddings=4096, rms_norm_eps=1e-6)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("smollm2-135m", "qwen3-0.6b", "tiny-qwen3"), default="smollm2-135m",
                    help="tiny-qwen3: the built-in tiny random model (a smoke test of this script)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers of qwen3-0.6b (default 28)")
    ap.add_argument("--tp", type=int, default=1, help="the project's tensor-parallel size (DP = world / TP)")
    ap.add_argument("--samples", type=int, default=32, help="responses per global step (all DP ranks)")
    ap.add_argument("--mini-batches", type=int, default=2, help="optimizer steps per global step")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--response-len", type=int, default=16)
    ap.add_argument("--order", choices=("interleaved", "sequential"), default="interleaved")
    ap.add_argument("--warmup", type=int, default=1, help="untimed global steps")
    ap.add_argument("--steps", type=int, default=3, help="timed global steps")
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file (rank 0)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the job's config (e.g. "
                                                 "parallelism.overlap_grad_reduce=true)")
    return ap.parse_args(argv)


def job_config(a, path: str):
    """The embedded job's config at ``--tp``, for ``path``'s model."""
    from mcpo_megatron.config import load_config

    return load_config(str(JOB), [f"parallelism.tensor_model_parallel_size={a.tp}", f"model.path={path}",
                                  f"data.max_prompt_length={a.prompt_len}",
                                  f"data.max_response_length={a.response_len}", *a.overrides])


# ------------------------------------------------------------------------------------------ the weights
def model_dir(a, tmp: Path, info) -> str:
    """A Hugging Face directory both sides load: SmolLM2-135M-Instruct as shipped, or Qwen3-0.6B's shape with
    seeded random weights (written by rank 0)."""
    import torch.distributed as dist

    if a.model in ("smollm2-135m", "tiny-qwen3"):
        from mcpo_megatron.models.sources import resolve_model_path

        return resolve_model_path("builtin:" + {"smollm2-135m": "smollm2-135m-instruct"}.get(a.model, a.model))
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = tmp / "qwen3-0.6b"
    if dist.is_initialized():  # every rank's own temporary directory: all read rank 0's
        from mcpo_megatron.parallel.distributed import broadcast_object

        path = Path(broadcast_object(str(path), src=0))
    if info.rank == 0:
        cfg = Qwen3Config(**dict(QWEN3_0_6B, num_hidden_layers=a.layers or QWEN3_0_6B["num_hidden_layers"]))
        cfg.architectures = ["Qwen3ForCausalLM"]
        torch.manual_seed(0)
        Qwen3ForCausalLM(cfg).save_pretrained(path)
    if dist.is_initialized():
        dist.barrier()
    return str(path)


# ------------------------------------------------------------------------------------------ the batch
def global_batch(a, vocab: int, cfg) -> dict:
    """The global step's sequences (the same on every rank) and their per-token loss inputs: half the groups'
    responses mastered (hinge weights on), advantages of both signs."""
    from mcpo_megatron.algorithms.losses import local_counts, token_weights

    g = torch.Generator().manual_seed(1)
    n, p, r = a.samples, a.prompt_len, a.response_len
    ids = torch.randint(0, vocab, (n, p + r), generator=g)
    mask = torch.ones(n, r, dtype=torch.bool)
    mastered = torch.arange(n) % 4 == 0
    per_mini = n // a.mini_batches
    pg, hk = [], []
    for m in range(a.mini_batches):
        rows = slice(m * per_mini, (m + 1) * per_mini)
        w, h = token_weights(mask[rows], mastered[rows], loss_agg_mode=cfg.algorithm.loss_agg_mode,
                             global_counts=local_counts(mask[rows], mastered[rows]),
                             hinge_agg=cfg.algorithm.mcpo.hinge_kl.agg)
        pg.append(w)
        hk.append(h)
    return dict(ids=ids, mask=mask, pg_weight=torch.cat(pg), hkl_weight=torch.cat(hk),
                advantage=torch.randn(n, generator=g), per_mini=per_mini)


def rank_rows(b: dict, mini: int | None, dp: int, dp_rank: int) -> slice:
    """This DP rank's share of mini-batch ``mini`` (None: of the whole global batch)."""
    size = b["per_mini"] if mini is not None else len(b["ids"])
    share = size // dp
    start = (mini or 0) * size + dp_rank * share
    return slice(start, start + share)


def project_batch(b: dict, rows: slice, prompt_len: int):
    from mcpo_megatron.models.batch import SequenceBatch

    ids = b["ids"][rows]
    n, total = ids.shape
    return SequenceBatch(
        input_ids=list(ids), prompt_lens=torch.full((n,), prompt_len),
        response_lens=torch.full((n,), total - prompt_len),
        token_fields={"old_logp": list(b["old_logp"][rows]), "pg_weight": list(b["pg_weight"][rows]),
                      "hkl_weight": list(b["hkl_weight"][rows]),
                      "advantages": [torch.full((total - prompt_len,), float(x)) for x in b["advantage"][rows]]})




# ------------------------------------------------------------------------------------------ timing
class PhaseTimer:
    """Seconds per phase, summed until :meth:`take`; CUDA is synchronised at each edge."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            sync()
            self.seconds[phase] += time.perf_counter() - t0

    def wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            with self(phase):
                return fn(*args, **kwargs)
        return timed

    def take(self) -> dict[str, float]:
        out, self.seconds = dict(self.seconds), defaultdict(float)
        return out


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------ the project
class Project:
    """MegatronPolicy with timers around megatron's forward and backward steps, the log-probs, the loss, the
    gradient reduction and the optimizer step."""

    def __init__(self, a, cfg, info):
        from megatron.core.pipeline_parallel import schedules

        from mcpo_megatron.trainer.components import build_policy
        from mcpo_megatron.trainer.loop import make_loss_fn

        self.a, self.info, self.timer = a, info, PhaseTimer()
        self.policy = build_policy(cfg, cfg.model.path, info)
        self._job_loss = make_loss_fn(cfg)
        t, p = self.timer, self.policy
        self._schedules = schedules
        self._originals = (schedules.forward_step, schedules.backward_step)
        schedules.forward_step = t.wrap("forward", schedules.forward_step)
        schedules.backward_step = t.wrap("backward", schedules.backward_step)
        p._response_logprobs = t.wrap("logprobs+loss", p._response_logprobs)
        for d in p.ddps:
            d.module.config.finalize_model_grads_func = t.wrap("grad reduction",
                                                               d.module.config.finalize_model_grads_func)
        p.optimizer.step = t.wrap("optimizer", p.optimizer.step)

    def loss_fn(self, logp, entropy, mb):
        with self.timer("logprobs+loss"):
            return self._job_loss(logp, entropy, mb)

    def train(self, b: dict) -> tuple[float, dict, list[float]]:
        """(seconds, phases, the mini-batches' losses) of the training phase."""
        sync()
        t0 = time.perf_counter()
        losses = []
        for m in range(self.a.mini_batches):
            batch = project_batch(b, rank_rows(b, m, self.info.dp, self.info.dp_rank), self.a.prompt_len)
            losses.append(self.policy.train_step(batch, self.loss_fn)["loss"])
        sync()
        total = time.perf_counter() - t0
        return total, split_rest(self.timer.take(), total), losses

    def old_logprobs(self, b: dict) -> float:
        batch = project_batch(b, rank_rows(b, None, self.info.dp, self.info.dp_rank), self.a.prompt_len)
        sync()
        t0 = time.perf_counter()
        self.policy.compute_logprobs(batch, compute_entropy=False)
        sync()
        self.timer.take()
        return time.perf_counter() - t0

    def close(self) -> None:
        self._schedules.forward_step, self._schedules.backward_step = self._originals
        del self.policy
        gc.collect()


def split_rest(phases: dict[str, float], total: float) -> dict[str, float]:
    """The phases with the project's forward step less the log-probs and loss computed inside it, and the rest."""
    out = {k: phases.get(k, 0.0) for k in PHASES[:-1]}
    out["forward"] -= out["logprobs+loss"]  # megatron's forward_step calls the loss function
    out["rest"] = total - sum(out.values())
    return out


# ------------------------------------------------------------------------------------------ the reference
class Reference:
    """The plain trainer: transformers model, torch DDP, full-vocabulary log_softmax, AdamW."""

    def __init__(self, a, cfg, info):
        import torch.distributed as dist
        from transformers import AutoModelForCausalLM

        from mcpo_megatron.algorithms.losses import LossSettings

        self.a, self.timer = a, PhaseTimer()
        self.loss_settings = LossSettings.from_config(cfg.algorithm)
        self.budget = cfg.trainer.max_tokens_per_microbatch
        o = cfg.optimizer
        self.clip = o.grad_clip
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        device = info.device
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        self.model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=dtype).to(device).train()
        self.ddp = torch.nn.parallel.DistributedDataParallel(self.model) if self.world > 1 else self.model
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2),
                                     eps=o.adam_eps, weight_decay=o.weight_decay)
        self.device = device

    def _microbatches(self, rows: slice) -> list[slice]:
        per = max(1, self.budget // (self.a.prompt_len + self.a.response_len))
        return [slice(s, min(s + per, rows.stop)) for s in range(rows.start, rows.stop, per)]

    def _logp(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        p = self.a.prompt_len
        return torch.log_softmax(logits[:, p - 1:-1].float(), dim=-1).gather(-1, ids[:, p:, None])[..., 0]

    def _loss(self, logp: torch.Tensor, b: dict, rows: slice):
        from mcpo_megatron.algorithms.losses import LossInputs, policy_loss

        f = {k: b[k][rows].to(self.device) for k in LOSS_FIELDS}
        inputs = LossInputs(logp, f["old_logp"], f["advantage"], f["pg_weight"], b["mask"][rows].to(self.device),
                            hkl_weight=f["hkl_weight"])
        return policy_loss(inputs, self.loss_settings)

    def train(self, b: dict) -> tuple[float, dict, list[float]]:
        t = self.timer
        sync()
        t0 = time.perf_counter()
        losses = []
        for m in range(self.a.mini_batches):
            self.opt.zero_grad(set_to_none=True)
            mbs = self._microbatches(rank_rows(b, m, self.world, self.rank))
            loss_sum = 0.0
            for i, rows in enumerate(mbs):
                ids = b["ids"][rows].to(self.device)
                sync_now = i == len(mbs) - 1 or self.world == 1
                with (contextlib.nullcontext() if sync_now else self.ddp.no_sync()):
                    with t("forward"):
                        logits = self.ddp(input_ids=ids).logits
                    with t("logprobs+loss"):
                        loss, _ = self._loss(self._logp(logits, ids), b, rows)
                    with t("backward"):
                        (loss * self.world).backward()  # DDP averages; the loss is a share of a global sum
                loss_sum += float(loss.detach())
            with t("optimizer"):
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
                self.opt.step()
            losses.append(all_sum(loss_sum))
        sync()
        total = time.perf_counter() - t0
        phases = {k: t.seconds.get(k, 0.0) for k in PHASES[:-1]}
        t.take()
        phases["rest"] = total - sum(phases.values())
        return total, phases, losses

    @torch.no_grad()
    def logprobs(self, b: dict, rows: slice) -> torch.Tensor:
        """The response tokens' log-probs of ``rows`` from a plain forward."""
        self.model.eval()
        out = []
        for mb in self._microbatches(rows):
            ids = b["ids"][mb].to(self.device)
            out.append(self._logp(self.model(input_ids=ids).logits, ids).cpu())
        self.model.train()
        return torch.cat(out)

    def old_logprobs(self, b: dict) -> float:
        """Seconds of the log-probs of this rank's share."""
        sync()
        t0 = time.perf_counter()
        self.logprobs(b, rank_rows(b, None, self.world, self.rank))
        sync()
        return time.perf_counter() - t0

    def close(self) -> None:
        del self.ddp, self.model, self.opt
        gc.collect()


def all_sum(x: float) -> float:
    import torch.distributed as dist

    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t)


def slowest(x: float) -> float:
    """The largest of every rank's ``x`` (a step ends when its slowest rank does)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


# ------------------------------------------------------------------------------------------ the run
def one_step(side, b: dict, rec: dict, timed: bool) -> None:
    """One global step's training phase and old log-probs of ``side``, recorded (the slowest rank's) if timed."""
    total, phases, losses = side.train(b)
    old = side.old_logprobs(b)
    rec["losses"] = rec["losses"] or losses
    if timed:
        rec["train"].append(slowest(total))
        rec["phases"].append({k: slowest(v) for k, v in phases.items()})
        rec["old_logprobs"].append(slowest(old))


def run(a, info, cfg, b: dict) -> dict[str, dict]:
    """{side: its figures}: both sides in turn in every step, or one after the other (``--order``)."""
    kinds = {"project": Project, "reference": Reference}
    recs = {name: {"train": [], "phases": [], "old_logprobs": [], "losses": None} for name in kinds}
    steps = range(a.warmup + a.steps)
    if a.order == "sequential":
        for name, kind in kinds.items():
            side = kind(a, cfg, info)
            for step in steps:
                one_step(side, b, recs[name], step >= a.warmup)
            side.close()
        return recs
    sides = {name: kind(a, cfg, info) for name, kind in kinds.items()}
    for step in steps:
        for name, side in sides.items():
            one_step(side, b, recs[name], step >= a.warmup)
    return recs


def report(a, info, recs: dict, microbatches: int) -> None:
    med = lambda xs: statistics.median(xs)  # noqa: E731
    proj, ref = recs["project"], recs["reference"]
    rows = [("training phase", med(proj["train"]), med(ref["train"]))]
    rows += [(f"- {k}", med([p[k] for p in proj["phases"]]), med([p[k] for p in ref["phases"]])) for k in PHASES]
    rows.append(("old log-probs", med(proj["old_logprobs"]), med(ref["old_logprobs"])))
    print(describe())
    print(f"model {a.model}" + (f" ({a.layers} layers)" if a.layers else "") +
          f", project TP={info.tp} DP={info.dp}" + (f" ({' '.join(a.overrides)})" if a.overrides else "") +
          f", reference DP={info.world_size}; {a.samples} samples of "
          f"{a.prompt_len}+{a.response_len} tokens, {a.mini_batches} mini-batches, {microbatches} micro-batch(es) "
          f"per mini-batch and rank; medians of {a.steps} steps, order {a.order}")
    print(f"first step's mini-batch losses: project {[f'{x:.6g}' for x in proj['losses']]}, "
          f"reference {[f'{x:.6g}' for x in ref['losses']]}")
    print("| phase | project s | reference s | project / reference |")
    print("|---|---:|---:|---:|")
    for name, p, r in rows:
        print(f"| {name} | {p:.3f} | {r:.3f} | " + (f"{p / r:.2f}x |" if r > 0 else "- |"))
    if a.json:
        Path(a.json).write_text(json.dumps(dict(machine=describe(), args=vars(a), tp=info.tp, dp=info.dp,
                                                rows=rows, raw=recs), indent=1))


def main(argv=None) -> int:
    a = parse_args(argv)
    from mcpo_megatron.parallel.distributed import destroy_distributed, init_distributed

    info = init_distributed(a.tp, 1, seed=0)
    if a.samples % (a.mini_batches * info.world_size):
        raise SystemExit(f"--samples={a.samples} must split into {a.mini_batches} mini-batches over "
                         f"{info.world_size} ranks evenly")
    with tempfile.TemporaryDirectory(prefix="bench-vs-plain-") as tmp:
        path = model_dir(a, Path(tmp), info)
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(path).vocab_size
        cfg = job_config(a, path)
        b = global_batch(a, vocab, cfg)
        # old log-probs at the starting weights (so the ratios start at 1), from a plain forward
        first = Reference(a, cfg, info)
        b["old_logp"] = first.logprobs(b, slice(0, a.samples))
        first.close()
        recs = run(a, info, cfg, b)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()  # rank 0's directory holds the model every rank may still read
    per_rank = a.samples // a.mini_batches // info.dp
    microbatches = -(-per_rank * (a.prompt_len + a.response_len) // cfg.trainer.max_tokens_per_microbatch)
    if info.rank == 0:
        report(a, info, recs, microbatches)
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
