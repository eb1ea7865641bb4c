"""The rollout-engine interface: sampling parameters, outputs, and rollout data parallelism.

Every engine (the PyTorch :class:`~mcpo_megatron.rollout.engines.torch.engine.TorchRolloutEngine`,
the vLLM :class:`~mcpo_megatron.rollout.engines.vllm.engine.VLLMRolloutEngine`) implements
:class:`RolloutEngine`.  The trainer calls, once per iteration::

    engine.wake_up()
    resharder.push(engine)                          # the compiled plan writes into engine.weight_target()'s
                                                    # tensors in place; or, for an engine without one, the HF
                                                    # stream: begin_update(), update_weights(bucket) per bucket,
                                                    # finish_update()
    out = generate_data_parallel(engine, prompts, sampling, rollout_tp=R)
    engine.sleep()

The processed distribution
--------------------------
Log-probs reported by an engine are those of the sampled token under the
*processed* distribution, the one the token was actually drawn from (vLLM's
``logprobs_mode="processed_logprobs"``).  For one position with raw logits
``z`` (a vector over the vocabulary), :func:`process_logits` defines it as:

1. temperature: ``z = z / T`` (``T > 0``);
2. top-k (``top_k > 0``): tokens whose scaled logit is strictly below the k-th
   largest one are removed (set to ``-inf``); ties with the k-th value are kept;
3. top-p (``top_p < 1``): on the top-k-truncated distribution ``p = softmax(z)``,
   sort tokens by increasing probability and remove every token whose cumulative
   (ascending) probability is ``<= 1 - top_p``; the most likely token is always
   kept.  Equivalently: keep the smallest set of most likely tokens whose mass
   reaches ``top_p`` (plus tokens tied at the boundary in order of sort);
4. ``logp = log_softmax(z)`` over the kept tokens (renormalised).

This is exactly vLLM 0.32's ``Sampler`` order (temperature, then
``apply_top_k_top_p``, then ``log_softmax``).  Greedy decoding (``T == 0``)
takes ``argmax(z)`` and reports ``log_softmax(z)`` of the *raw* logits (as vLLM
does for all-greedy batches): temperature and truncation are not applied.

Interruption
------------
``generate`` takes ``should_stop``, a callable the engine polls between decoding
steps (every rank of a tensor-parallel engine reaches the same answer: the
engine agrees on it over its TP group).  When it returns True the engine drops
the call's requests and raises :class:`GenerationInterrupted`;
:func:`generate_data_parallel` makes every rank raise it when any replica was
interrupted.  The trainer uses it to checkpoint at once when a preemption
signal arrives during generation (the policy then still holds the weights the
step started from).

Determinism
-----------
Sample ``i`` of global prompt ``j`` draws its random numbers from a generator
seeded with :func:`sample_seed` ``(sampling.seed, j, i)``, so outputs do not
depend on how prompts are split across rollout replicas or batched.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch

if TYPE_CHECKING:
    from mcpo_megatron.rollout.weights.target import WeightTarget

FINISH_STOP = "stop"
FINISH_LENGTH = "length"

StopPoll = Callable[[], bool]


class GenerationInterrupted(Exception):
    """Generation was ended early by ``should_stop`` (no sample of the call is returned)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample responses.

    Attributes:
        n: samples per prompt (>= 1).
        temperature: softmax temperature (> 0), or 0 for greedy decoding.
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 or -1 disables it.
        max_new_tokens: response length cap (>= 1); reaching it gives finish "length".
        stop_token_ids: token ids that end a response (finish "stop"); the engine
            adds the tokenizer's EOS ids it was built with.  The stop token is part
            of the response and has a log-prob.
        seed: base seed; see :func:`sample_seed`.
        stop_strings: texts that may end a response at the token completing one of them (episodes with the
            Python tool: the closing fence of a code block). vLLM stops there (its detokenizer drops the tokens
            after that one); the PyTorch engine does not look at text and goes on to a stop token or the cap, so a
            caller that needs the cut makes it itself (``rollout/episodes.py`` does, for both engines).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(str(t) for t in self.stop_strings))
        problems = []
        if not isinstance(self.n, int) or self.n < 1:
            problems.append(f"n={self.n!r} must be an integer >= 1")
        if not (self.temperature >= 0.0):
            problems.append(f"temperature={self.temperature!r} must be >= 0 (0 = greedy)")
        if not (0.0 < self.top_p <= 1.0):
            problems.append(f"top_p={self.top_p!r} must be in (0, 1] (1 disables nucleus sampling)")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            problems.append(f"top_k={self.top_k!r} must be an integer >= -1 (0 or -1 disables it)")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            problems.append(f"max_new_tokens={self.max_new_tokens!r} must be an integer >= 1")
        if any(not t for t in self.stop_strings):
            problems.append(f"stop_strings={self.stop_strings!r} must not hold an empty string")
        if problems:
            raise ValueError("invalid SamplingParams: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_config(cls, rollout_cfg, *, stop_token_ids: Sequence[int] = (), seed: int | None = None):
        """Build from the ``rollout`` config section (keys n, temperature, top_p, top_k,
        max_new_tokens, seed)."""
        return cls(
            n=int(rollout_cfg.n),
            temperature=float(rollout_cfg.temperature),
            top_p=float(rollout_cfg.top_p),
            top_k=int(rollout_cfg.top_k),
            max_new_tokens=int(rollout_cfg.max_new_tokens),
            stop_token_ids=tuple(stop_token_ids),
            seed=int(rollout_cfg.seed if seed is None else seed),
        )


@dataclass(frozen=True)
class EpisodeStats:
    """What an episode's tool use came to: ``turns`` generated, ``calls`` run, how many calls did not end well
    (``errors``: any status but ok), how many of those were the code's doing (``failures``: all but
    ``unavailable``, the sandbox's own failure; ``tools.call_penalty`` counts these), how many ran out of time
    (``timeouts``), and the calls' wall-clock seconds."""

    turns: int = 1
    calls: int = 0
    errors: int = 0
    failures: int = 0
    timeouts: int = 0
    seconds: float = 0.0


@dataclass
class RolloutSample:
    """One response: ``token_ids`` (response only, including the stop token when one was
    generated), the processed log-prob of each token, and why it ended."""

    prompt_index: int
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    # With routing output on (MoE models): the experts each token the engine ran was routed to, an integer
    # [prompt_len + len(token_ids) - 1, num_layers, top-k] tensor (model.moe_routing_replay=r3 replays it).
    routed_experts: Any = None
    # generate_data_parallel(keep_routing_local=True): the rank (in its group) that holds routed_experts when
    # this copy does not carry it; -1 when the routing travels with the sample or there is none
    routing_rank: int = -1
    # partial rollouts (rollout/engines/records.py): the policy version that sampled each token; None when one version
    # sampled them all (the batch's)
    versions: list[int] | None = None
    # episodes with the Python tool (rollout/episodes.py): True on the tokens the engine sampled, False on the tool
    # outputs appended between turns (log-prob 0.0: never sampled; trained on by no term); None: every token sampled
    model_mask: list[bool] | None = None
    # the episode's turns and tool calls (rollout/episodes.py), or None for a reply generated in one go
    episode: "EpisodeStats | None" = None

    def __post_init__(self):
        if self.model_mask is not None and len(self.model_mask) != len(self.token_ids):
            raise ValueError(
                f"RolloutSample(prompt {self.prompt_index}, sample {self.sample_index}): "
                f"{len(self.token_ids)} tokens but {len(self.model_mask)} model_mask entries"
            )
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"RolloutSample(prompt {self.prompt_index}, sample {self.sample_index}): "
                f"{len(self.token_ids)} tokens but {len(self.logprobs)} log-probs"
            )
        if self.versions is not None and len(self.versions) != len(self.token_ids):
            raise ValueError(
                f"RolloutSample(prompt {self.prompt_index}, sample {self.sample_index}): "
                f"{len(self.token_ids)} tokens but {len(self.versions)} versions"
            )
        if self.finish_reason not in (FINISH_STOP, FINISH_LENGTH):
            raise ValueError(f"finish_reason={self.finish_reason!r} must be 'stop' or 'length'")


@dataclass
class RolloutOutput:
    """All samples of a prompt list, prompt-major: prompt 0 samples 0..n-1, prompt 1 ...

    ``prompt_index`` is the index in the *global* prompt list given to
    :func:`generate_data_parallel` (or to ``engine.generate`` with ``prompt_indices``).
    """

    samples: list[RolloutSample] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self):
        return iter(self.samples)

    @property
    def prompt_indices(self) -> list[int]:
        return [s.prompt_index for s in self.samples]

    @property
    def token_ids(self) -> list[list[int]]:
        return [s.token_ids for s in self.samples]

    @property
    def logprobs(self) -> list[list[float]]:
        return [s.logprobs for s in self.samples]

    @property
    def finish_reasons(self) -> list[str]:
        return [s.finish_reason for s in self.samples]

    @property
    def routed_experts(self) -> list | None:
        """Per sample, the engine's routing (see :class:`RolloutSample`); None unless every sample has one.
        With the routing kept where it was generated (:attr:`routing_ranks`): the routing held on this rank,
        None for the other samples."""
        routes = [s.routed_experts for s in self.samples]
        if self.routing_ranks is not None:
            return routes
        return None if any(r is None for r in routes) else routes

    @property
    def routing_ranks(self) -> list[int] | None:
        """Per sample, the rank holding its routing (``generate_data_parallel(keep_routing_local=True)``);
        None when the routing travels with the samples."""
        ranks = [s.routing_rank for s in self.samples]
        return ranks if any(r >= 0 for r in ranks) else None

    @staticmethod
    def concat(parts: Iterable["RolloutOutput"]) -> "RolloutOutput":
        return RolloutOutput([s for p in parts for s in p.samples])


class RolloutEngine(abc.ABC):
    """A generation engine whose weights the trainer replaces every iteration."""

    def weight_target(self) -> WeightTarget | None:
        """The tensors a weight update writes in place (:class:`~mcpo_megatron.rollout.weights.target.WeightTarget`), or None when the engine takes the
        Hugging Face stream only (:meth:`update_weights`). Default: None."""
        return None

    @abc.abstractmethod
    def generate(
        self,
        prompts_token_ids: list[list[int]],
        sampling: SamplingParams,
        *,
        prompt_indices: Sequence[int] | None = None,
        should_stop: StopPoll | None = None,
    ) -> RolloutOutput:
        """Sample ``sampling.n`` responses per prompt.

        ``prompt_indices`` are the prompts' global indices (default ``0..len-1``); they
        seed the samples and label the output.  ``should_stop`` is polled between
        decoding steps; True ends the call with :class:`GenerationInterrupted`.
        """

    def open_session(self, prompts_token_ids: Sequence[Sequence[int]], records, sampling: SamplingParams):
        """Start generating ``records`` (``rollout/engines/records.py``: responses so far, one per prompt) in segments;
        returns a :class:`~mcpo_megatron.rollout.engines.records.GenerationSession`. ``sampling.n`` is not read (each record
        is one sample) and ``sampling.seed`` neither (each record has its own)."""
        raise NotImplementedError(f"{type(self).__name__} does not generate in segments (partial rollouts)")

    def leads_engine(self) -> bool:
        """Whether this rank is the first of its engine's ranks (a tensor-parallel engine spans several): the one
        that does what must happen once per engine, such as running an episode's tool calls. Default: True."""
        return True

    def share_within_engine(self, obj):
        """The first rank's ``obj`` on every rank of this engine (host objects, pickled), so that they all
        continue from the same tool outputs. Default (one rank per engine): ``obj``."""
        return obj

    def begin_update(self) -> None:
        """Called once before the first bucket of a weight update.  Default: nothing."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``(hf_name, tensor)`` pairs into the engine's weights in place.

        Called once per reshard bucket; the tensors may be freed after it returns.
        """

    def finish_update(self) -> None:
        """Called once after the last bucket of a weight update (e.g. to drop caches
        computed with the old weights).  Default: nothing."""

    def close(self) -> None:
        """Release the engine for good (before the process group is destroyed).  Default: nothing."""

    @abc.abstractmethod
    def sleep(self) -> None:
        """Release generation memory (KV cache, and weights where the engine can) for training."""

    @abc.abstractmethod
    def wake_up(self) -> None:
        """Undo :meth:`sleep` before the next weight update / generation."""


# --------------------------------------------------------------------------- seeding
def sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """A 63-bit seed for sample ``sample_index`` of global prompt ``prompt_index``.

    A hash (not ``seed + j * n + i``) so nearby base seeds give unrelated streams.
    """
    digest = hashlib.blake2b(
        f"{int(seed)}/{int(prompt_index)}/{int(sample_index)}".encode(), digest_size=8
    ).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def batch_seed(seed: int, step: int, batch: int | str) -> int:
    """A 63-bit base seed for generation batch ``batch`` of global step ``step``: an index (dynamic sampling
    generates several batches per step) or a name (``"retention_probe"``).  A hash, like :func:`sample_seed`,
    so no two batches of any steps share a seed, however many batches a step generates."""
    digest = hashlib.blake2b(f"batch/{int(seed)}/{int(step)}/{batch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


# --------------------------------------------------------------------------- processing
def process_logits(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = -1) -> torch.Tensor:
    """Logits of the processed distribution (see the module docstring), removed tokens at -inf.

    ``logits``: [..., V] raw logits (any float dtype; the result has the same dtype).
    Greedy (``temperature == 0``) returns the raw logits unchanged.
    """
    if temperature == 0.0:
        return logits
    z = logits / temperature
    vocab = z.shape[-1]
    if top_k is not None and 0 < top_k < vocab:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        z_sorted, order = torch.sort(z, dim=-1, descending=False)
        cum = torch.softmax(z_sorted, dim=-1).cumsum(dim=-1)
        drop = cum <= (1.0 - top_p)
        drop[..., -1] = False
        z_sorted = z_sorted.masked_fill(drop, float("-inf"))
        z = torch.empty_like(z).scatter_(-1, order, z_sorted)
    return z


def processed_logprobs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = -1) -> torch.Tensor:
    """``log_softmax`` of :func:`process_logits` ([..., V]; removed tokens at -inf)."""
    return torch.log_softmax(process_logits(logits, temperature, top_p, top_k), dim=-1)


# --------------------------------------------------------------------------- data parallel
def replica_slices(num_prompts: int, num_replicas: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` prompt ranges, one per replica, sizes differing by <= 1."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas={num_replicas!r} must be >= 1")
    base, extra = divmod(num_prompts, num_replicas)
    out, start = [], 0
    for r in range(num_replicas):
        stop = start + base + (1 if r < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def generate_data_parallel(
    engine: RolloutEngine,
    prompts_token_ids: list[list[int]],
    sampling: SamplingParams,
    *,
    rollout_tp: int = 1,
    group=None,
    first_index: int = 0,
    should_stop: StopPoll | None = None,
    keep_routing_local: bool = False,
) -> RolloutOutput:
    """Generate for the global prompt list with rollout data parallelism.

    The ``world_size / rollout_tp`` rollout replicas (replica = rank // rollout_tp; the
    ranks of one replica form one tensor-parallel engine and get the same prompts) each
    generate a contiguous slice of the prompts; the slices are all-gathered so every
    rank returns the full :class:`RolloutOutput` in global prompt-major order.  Without
    a process group this is ``engine.generate(prompts, sampling)``.  ``first_index`` is
    the global index of the first prompt (samples are seeded by global index), so a long
    list generated in consecutive pieces gives the same samples as one call.  When any
    replica's generation was interrupted (``should_stop``), every rank raises
    :class:`GenerationInterrupted` after the gather.

    ``keep_routing_local``: the engine's routing (``RolloutSample.routed_experts``, MoE with R3; the largest
    part of a sample) is not gathered: each rank keeps its own replica's and learns, per sample, which rank
    holds it (``RolloutSample.routing_rank``, the replica's first rank) so the trainer fetches only the
    routing of the samples it trains (``trainer.step_data.fetch_routing``).
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return engine.generate(prompts_token_ids, sampling, should_stop=should_stop,
                               prompt_indices=range(first_index, first_index + len(prompts_token_ids)))
    from mcpo_megatron.parallel.distributed import all_gather_objects

    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if rollout_tp < 1 or world % rollout_tp != 0:
        raise ValueError(
            f"rollout_tp={rollout_tp!r} must be >= 1 and divide the world size {world}; "
            "set rollout.tensor_parallel_size to a divisor of the number of processes"
        )
    num_replicas = world // rollout_tp
    replica = rank // rollout_tp
    start, stop = replica_slices(len(prompts_token_ids), num_replicas)[replica]
    try:
        local = engine.generate(prompts_token_ids[start:stop], sampling, should_stop=should_stop,
                                prompt_indices=range(first_index + start, first_index + stop))
    except GenerationInterrupted:
        local = None
    sent = local if rank % rollout_tp == 0 else None
    keep_routing_local = keep_routing_local and local is not None and local.routed_experts is not None
    if keep_routing_local:
        leader = replica * rollout_tp
        local = RolloutOutput([dataclasses.replace(s, routing_rank=leader) for s in local.samples])
        if sent is not None:
            sent = RolloutOutput([dataclasses.replace(s, routed_experts=None) for s in local.samples])
    gathered = all_gather_objects((local is None, sent), group=group)
    if any(interrupted for interrupted, _ in gathered):
        raise GenerationInterrupted("generation interrupted on at least one rank")
    parts = [part for _, part in gathered[::rollout_tp]]
    if keep_routing_local:
        parts[replica] = local  # this replica's samples with their routing
    return RolloutOutput.concat(parts)
