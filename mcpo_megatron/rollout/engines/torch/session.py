"""The PyTorch engine's generation session: records decoded in segments (``rollout/engines/records.py``).

Records are cut into chunks of ``max_batch_size`` rows, in order; each chunk is a left-padded batch with its own
KV cache, built at the chunk's first step by prefilling every row's prompt and tokens so far (a continued record
is re-prefilled: no KV cache outlives a session). Within a session the cache is kept from segment to segment, so
a weight update between two segments (in-flight updates, docs/algorithms.md §13.2) would continue the running rows
on the KV their earlier tokens computed. Each decoding step samples exactly as :meth:`TorchRolloutEngine._generate_batch` does: row ``r`` draws
the k-th uniform of the generator seeded by its record's ``seed`` for its k-th token, so a record continued at
token k samples what an uninterrupted call would have, up to the rounding of a batched prefill against
incremental decoding. The token sampled last in a segment is run through the model at the start of the next one.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch

from mcpo_megatron.rollout.engines.interface import FINISH_LENGTH, FINISH_STOP, GenerationInterrupted, SamplingParams, StopPoll
from mcpo_megatron.rollout.engines.torch.cache import keep_cache_rows
from mcpo_megatron.rollout.engines.records import GenerationSession, SequenceRecord, check_session_inputs, extend_routing


class SessionEngine(Protocol):
    """What a session uses of the engine that opens it, declared here so that the session does not import its
    engine back: :class:`~mcpo_megatron.rollout.engines.torch.engine.TorchRolloutEngine` has all of it."""

    device: torch.device
    max_batch_size: int
    eos_token_ids: list[int]
    _routing: Any  # the engine's routing capture (r3), or None

    def _check_awake(self, what: str) -> None: ...

    def _forward(self, input_ids, attention_mask, position_ids, cache): ...

    def _sample(self, logits: torch.Tensor, sampling: SamplingParams, u: torch.Tensor): ...


class _Row:
    """One record being generated: its prompt, the record (grown in place) and its uniforms."""

    def __init__(self, prompt: Sequence[int], record: SequenceRecord, sampling: SamplingParams):
        self.prompt = [int(t) for t in prompt]
        self.record = SequenceRecord(record.prompt_index, record.sample_index, record.seed,
                                     list(record.token_ids), list(record.logprobs), list(record.versions),
                                     None, record.routed_experts, record.restarts)
        self.uniforms = None
        if not sampling.greedy:  # the same stream as an uninterrupted call: uniform k for token k
            g = torch.Generator().manual_seed(int(record.seed))
            self.uniforms = torch.rand(sampling.max_new_tokens, generator=g, dtype=torch.float64)
        self.routes: list[torch.Tensor] = []  # positions run in this session (r3)

    @property
    def context(self) -> list[int]:
        return self.prompt + self.record.token_ids


class _Chunk:
    """Up to ``max_batch_size`` rows decoded together with one KV cache."""

    def __init__(self, engine: SessionEngine, rows: list[_Row]):
        self.engine, self.rows = engine, rows
        self.active = torch.arange(len(rows))          # chunk position of each live batch row
        self.cache = self.attention_mask = self.next_pos = None
        self.pending: torch.Tensor | None = None       # the tokens sampled last, not yet run
        self.logits: torch.Tensor | None = None

    def _prefill(self) -> None:
        eng, dev = self.engine, self.engine.device
        contexts = [self.rows[int(r)].context for r in self.active]
        width = max(len(c) for c in contexts)
        input_ids = torch.zeros(len(contexts), width, dtype=torch.long)
        mask = torch.zeros(len(contexts), width, dtype=torch.long)
        for k, c in enumerate(contexts):  # left padding: the last column is every row's last token
            input_ids[k, width - len(c):] = torch.tensor(c, dtype=torch.long)
            mask[k, width - len(c):] = 1
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        self.attention_mask, position_ids = mask.to(dev), position_ids.to(dev)
        self.logits, self.cache = eng._forward(input_ids.to(dev), self.attention_mask, position_ids, None)
        if eng._routing is not None:
            run = eng._routing.take(len(contexts), width)
            for k, c in enumerate(contexts):
                self.rows[int(self.active[k])].routes.append(run[k, width - len(c):])
        self.next_pos = position_ids[:, -1:] + 1

    def _run_pending(self) -> None:
        eng, dev = self.engine, self.engine.device
        self.attention_mask = torch.cat([self.attention_mask, self.attention_mask.new_ones(len(self.active), 1)], 1)
        self.logits, self.cache = eng._forward(self.pending.to(dev).unsqueeze(-1), self.attention_mask,
                                               self.next_pos, self.cache)
        if eng._routing is not None:
            run = eng._routing.take(len(self.active), 1)
            for k, r in enumerate(self.active.tolist()):
                self.rows[r].routes.append(run[k])
        self.next_pos = self.next_pos + 1
        self.pending = None

    def _keep(self, keep: torch.Tensor) -> None:
        """Drop the finished rows from the batch and the cache."""
        idx = keep.nonzero().squeeze(-1)
        dev = self.engine.device
        self.active = self.active[idx]
        if self.cache is not None:
            keep_cache_rows(self.cache, idx.to(dev))
            self.attention_mask = self.attention_mask[idx.to(dev)]
            self.next_pos = self.next_pos[idx.to(dev)]
        if self.pending is not None:
            self.pending = self.pending[idx]

    def step(self, max_tokens: int, sampling: SamplingParams, stop_t: torch.Tensor, version: int,
             should_stop: StopPoll | None) -> None:
        for t in range(max_tokens):
            if len(self.active) == 0:
                return
            if should_stop is not None and should_stop():
                raise GenerationInterrupted(f"stopped after {t} decoding steps of a segment")
            if self.cache is None:
                self._prefill()
            elif self.pending is not None:
                self._run_pending()
            rows = [self.rows[int(r)] for r in self.active]
            offsets = torch.tensor([len(row.record.token_ids) for row in rows])
            u = (torch.empty(len(rows), dtype=torch.float64) if sampling.greedy
                 else torch.stack([row.uniforms[int(k)] for row, k in zip(rows, offsets)]))
            tok, lp = self.engine._sample(self.logits, sampling, u)
            hit_stop = torch.isin(tok, stop_t) if stop_t.numel() else torch.zeros_like(tok, dtype=torch.bool)
            at_cap = offsets + 1 >= sampling.max_new_tokens
            for k, row in enumerate(rows):
                rec = row.record
                rec.token_ids.append(int(tok[k]))
                rec.logprobs.append(float(lp[k]))
                rec.versions.append(int(version))
                if bool(hit_stop[k]):
                    rec.finish_reason = FINISH_STOP
                elif bool(at_cap[k]):
                    rec.finish_reason = FINISH_LENGTH
            self.pending = tok
            keep = ~(hit_stop | at_cap)
            if not bool(keep.all()):
                self._keep(keep)

    def close(self) -> None:
        self.cache = self.logits = self.pending = None


class TorchSession(GenerationSession):
    """Records generated by a :class:`~mcpo_megatron.rollout.engines.torch.engine.TorchRolloutEngine` (module docstring)."""

    def __init__(self, engine: SessionEngine, prompts: Sequence[Sequence[int]],
                 records: Sequence[SequenceRecord], sampling: SamplingParams):
        check_session_inputs(prompts, records, sampling)
        self.engine, self.sampling = engine, sampling
        self._rows = [_Row(p, r, sampling) for p, r in zip(prompts, records)]
        size = engine.max_batch_size
        self._chunks = [_Chunk(engine, self._rows[b:b + size]) for b in range(0, len(self._rows), size)]
        stop_ids = sorted(set(engine.eos_token_ids) | set(sampling.stop_token_ids))
        self._stop = torch.tensor(stop_ids, dtype=torch.long)

    @property
    def records(self) -> list[SequenceRecord]:
        return [row.record for row in self._rows]

    @torch.inference_mode()
    def step(self, max_tokens: int, *, version: int, should_stop: StopPoll | None = None) -> int:
        self.engine._check_awake("generate")
        for chunk in self._chunks:
            chunk.step(max_tokens, self.sampling, self._stop, version, should_stop)
        return self.running

    def close(self) -> list[SequenceRecord]:
        for chunk in self._chunks:
            chunk.close()
        out = []
        for row in self._rows:
            rec = row.record
            if row.routes:  # every position run, but the last sampled token (never run)
                run = torch.cat(row.routes)[: len(row.prompt) + len(rec.token_ids) - 1]
                rec.routed_experts = extend_routing(rec.routed_experts, run)
            out.append(rec)
        return out
