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

from mcpo_megatron.models.passes import PipelinePasses, as_dtype, check_context_parallel, set_schedule_options
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

    Args are those of :class:`~mcpo_megatron.models.policy.MegatronPolicy` that matter for log-probs; pass the
    policy's values (``temperature``, ``max_tokens_per_microbatch``, ``logprob_chunk_size``, ``sequence_parallel``,
    ``sequence_packing``, ``dtype``, ``transformer_impl``) so both compute the same numbers. They are not checked
    again here: the policy built from the same values checked them, and the log-prob kernel checks the temperature it
    divides by.
    """

    def __init__(
        self,
        hf_dir: str | os.PathLike,
        *,
        parallel_info=None,
        dtype: torch.dtype | str | None = None,
        max_tokens_per_microbatch: int = 8192,
        logprob_chunk_size: int = 4096,
        temperature: float = 1.0,
        transformer_impl: str = "auto",
        hf_config: Any = None,
        sequence_parallel: bool = False,
        sequence_packing: bool = False,
    ) -> None:
        from mcpo_megatron.models.builder import build_model_chunks
        from mcpo_megatron.models.hf_io import load_hf_weights
        from mcpo_megatron.parallel.distributed import parallel_info as _parallel_info

        self.info = parallel_info if parallel_info is not None else _parallel_info()
        self.dtype = as_dtype(dtype)
        self.max_tokens_per_microbatch = int(max_tokens_per_microbatch)
        self.sequence_packing = bool(sequence_packing)
        check_context_parallel(self.info, self.sequence_packing, "ReferencePolicy")
        self.logprob_chunk_size = int(logprob_chunk_size)
        self.temperature = float(temperature)
        self.hf_dir = str(hf_dir)
        if hf_config is None:
            from transformers import AutoConfig

            hf_config = AutoConfig.from_pretrained(self.hf_dir)
        self.hf_config = hf_config
        chunks = build_model_chunks(hf_config, dtype=self.dtype, transformer_impl=transformer_impl,
                                    sequence_parallel=bool(sequence_parallel) and self.info.tp > 1)
        set_schedule_options(chunks, self.info.pp)
        load_hf_weights(chunks, self.hf_dir)
        # The parameters keep requires_grad: megatron's parallel linear layers switch to another matmul path for
        # frozen weights (linear_with_frozen_weight), whose results differ from the policy's in the last bits.
        # No gradient is ever formed: log-probs are computed under no_grad and nothing calls backward here.
        self.ddps = [FrozenChunk(chunk) for chunk in chunks]
        shape = chunks[0].mcpo_shape
        self.vocab_size = int(shape.vocab_size)
        self.is_moe = bool(shape.is_moe)
        # The reference is the initial model as it routes by itself: routing replay (model.moe_routing_replay)
        # fixes the current policy's choices between its own passes and does not apply to it.
        self.routing = NoReplay()
