"""The frozen reference policy of the reference-KL term (``algorithm.kl``; GRPO's original recipe).

``ReferencePolicy`` is the initial policy, kept fixed for the whole run: this rank's Megatron model chunks on
the trainer's TP x PP x EP layout, loaded from the Hugging Face weights of ``model.path`` (also on a resumed
run, so the reference is always the run's starting point, never a checkpoint), in eval mode, forward only:
no gradients, gradient buffers or optimizer. It computes log-probs exactly as the policy does (the same micro-batching,
pipeline schedule and vocab-parallel kernel: both are :class:`~mcpo_megatron.models.passes.PipelinePasses`), so
before the first update its log-probs equal the policy's bit for bit.

Memory: one more copy of the stage's weights in the model dtype (``mcpo plan`` counts it).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from mcpo_megatron.models.passes import PipelinePasses, check_context_parallel, set_schedule_options
from mcpo_megatron.models.policy_settings import PolicySettings
from mcpo_megatron.models.routing_replay import NoReplay


class FrozenChunk(torch.nn.Module):
    """A model chunk where megatron's pipeline schedule expects a DDP wrapper (a ``module`` attribute), without
    DDP's gradient buffers; it stays in eval mode."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        self.train(False)

    def train(self, mode: bool = True):
        return super().train(False)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class ReferencePolicy(PipelinePasses):
    """The policy's forward-only passes over frozen weights: :meth:`compute_logprobs` only.

    ``settings`` are the policy's own (:class:`~mcpo_megatron.models.policy_settings.PolicySettings`), so that both
    compute the same numbers; of them the reference reads what log-probs depend on (dtype, micro-batch budget,
    kernel chunk, temperature, transformer implementation, sequence parallelism and packing).
    """

    def __init__(self, hf_dir: str | os.PathLike, settings: PolicySettings | None = None, *, parallel_info=None,
                 hf_config: Any = None) -> None:
        from mcpo_megatron.models.builder import build_model_chunks
        from mcpo_megatron.models.hf_io import load_hf_weights
        from mcpo_megatron.parallel.distributed import parallel_info as _parallel_info

        s = settings if settings is not None else PolicySettings()
        self.info = parallel_info if parallel_info is not None else _parallel_info()
        self.dtype = s.dtype
        self.max_tokens_per_microbatch = s.max_tokens_per_microbatch
        self.sequence_packing = s.sequence_packing
        check_context_parallel(self.info, self.sequence_packing, "ReferencePolicy")
        self.logprob_chunk_size = s.logprob_chunk_size
        self.temperature = float(s.temperature)
        self.hf_dir = str(hf_dir)
        if hf_config is None:
            from mcpo_megatron.models.multimodal import load_language_model_config

            hf_config = load_language_model_config(self.hf_dir)
        self.hf_config = hf_config
        chunks = build_model_chunks(hf_config, dtype=self.dtype, transformer_impl=s.transformer_impl,
                                    sequence_parallel=s.sequence_parallel and self.info.tp > 1)
        set_schedule_options(chunks, self.info.pp)
        load_hf_weights(chunks, self.hf_dir)
        # The parameters keep requires_grad: megatron's parallel linear layers switch to another matmul path for
        # frozen weights (linear_with_frozen_weight), whose results differ from the policy's in the last bits.
        # No gradient is ever formed: log-probs are computed under no_grad and nothing calls backward here.
        self.ddps = [FrozenChunk(chunk) for chunk in chunks]
        self._score_response_positions_only()
        shape = chunks[0].mcpo_shape
        self.vocab_size = int(shape.vocab_size)
        self.is_moe = bool(shape.is_moe)
        # The reference is the initial model as it routes by itself: routing replay (model.moe_routing_replay)
        # fixes the current policy's choices between its own passes and does not apply to it.
        self.routing = NoReplay()
