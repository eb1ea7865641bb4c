"""A fake engine that generates records in segments, for the tests of partial rollouts without a model: each
sample's response length is a function of its seed alone (drawn from a long-tailed mixture: most short, some at
the cap), and its k-th token is a function of (seed, k), so a record continued in another session, or after a
checkpoint, gets exactly the tokens an uninterrupted one would."""

from __future__ import annotations

import hashlib

from mcpo_megatron.rollout.engines.interface import FINISH_LENGTH, FINISH_STOP, GenerationInterrupted
from mcpo_megatron.rollout.engines.records import GenerationSession, SequenceRecord, check_session_inputs

STOP = 0


def _unit(*parts) -> float:
    digest = hashlib.blake2b("/".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def target_length(seed: int, max_new_tokens: int, long_frac: float = 0.2) -> int:
    """Most responses short (1 .. max/4), ``long_frac`` of them at the cap."""
    if _unit(seed, "long") < long_frac:
        return max_new_tokens
    return 1 + int(_unit(seed, "len") * max(1, max_new_tokens // 4))


def token(seed: int, k: int) -> int:
    return 1 + int(_unit(seed, k) * 50)


class FakeSession(GenerationSession):
    def __init__(self, engine, prompts, records, sampling):
        check_session_inputs(prompts, records, sampling)
        self.engine, self.sampling = engine, sampling
        self.records = [SequenceRecord(r.prompt_index, r.sample_index, r.seed, list(r.token_ids), list(r.logprobs),
                                       list(r.versions), None, r.routed_experts, r.restarts) for r in records]
        engine.sessions += 1

    def step(self, max_tokens, *, version, should_stop=None):
        cap = self.sampling.max_new_tokens
        for _ in range(max_tokens):
            if should_stop is not None and should_stop():
                raise GenerationInterrupted("stopped")
            running = [r for r in self.records if not r.finished]
            if not running:
                break
            self.engine.decode_steps += 1
            for r in running:
                k = len(r.token_ids)
                end = target_length(r.seed, cap, self.engine.long_frac)
                r.token_ids.append(STOP if k + 1 == end and end < cap else token(r.seed, k))
                r.logprobs.append(-0.5 - 0.01 * version)
                r.versions.append(int(version))
                if k + 1 == end:
                    r.finish_reason = FINISH_STOP if end < cap else FINISH_LENGTH
        return self.running

    def close(self):
        return self.records


class FakeEngine:
    """``open_session`` (and the sleep / wake-up a colocated placement calls)."""

    def __init__(self, long_frac: float = 0.2):
        self.long_frac = long_frac
        self.sessions = 0
        self.decode_steps = 0

    def open_session(self, prompts, records, sampling):
        return FakeSession(self, prompts, records, sampling)

    def wake_up(self):
        pass

    def sleep(self):
        pass
