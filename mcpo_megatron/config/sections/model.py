"""The ``model`` section: which model, its dtype and layers, mixture-of-experts options, and its shape for
machines without the weights (``model.arch``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from mcpo_megatron.config.checks import Checks, choice
from mcpo_megatron.model_files import BUILTIN_PREFIX, BUILTINS, TOKENIZER_MARKER_FILES, has_tokenizer, local_model_path


@dataclass
class ArchConfig:
    """Model shape, for when the Hugging Face config.json is not on this machine (planning, validation)."""
    num_layers: Optional[int] = None
    hidden_size: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_key_value_heads: Optional[int] = None     # null -> num_attention_heads (no GQA)
    ffn_hidden_size: Optional[int] = None
    vocab_size: Optional[int] = None
    head_dim: Optional[int] = None                # null -> hidden_size / num_attention_heads
    max_position_embeddings: Optional[int] = None
    tie_word_embeddings: bool = False
    family: Optional[str] = choice(None, "qwen3", "qwen3_moe", "qwen2", "llama", "qwen3_5_text", "qwen3_5_moe_text",
                                   "qwen3_next")
    # Mixture of experts (qwen3_moe; null for dense models): routed experts, experts per token, expert width,
    # and the width of the gated shared expert (Qwen3.5-MoE, Qwen3-Next).
    num_experts: Optional[int] = None
    num_experts_per_tok: Optional[int] = None
    moe_ffn_hidden_size: Optional[int] = None
    shared_expert_ffn_hidden_size: Optional[int] = None
    # Hybrid decoders (qwen3_5_text, qwen3_5_moe_text, qwen3_next; null otherwise): a full-attention layer every
    # full_attention_interval layers, the others Gated DeltaNet layers of these sizes.
    full_attention_interval: Optional[int] = None
    linear_num_key_heads: Optional[int] = None
    linear_num_value_heads: Optional[int] = None
    linear_key_head_dim: Optional[int] = None
    linear_value_head_dim: Optional[int] = None
    linear_conv_kernel_dim: Optional[int] = None


@dataclass
class ModelConfig:
    path: str = "Qwen/Qwen3-8B"                   # HF dir, hub name, or "builtin:smollm2-135m-instruct"
    dtype: str = choice("auto", "bf16", "fp32")  # auto: bf16 on GPU, fp32 on CPU
    tokenizer: Optional[str] = None               # null -> the tokenizer at model.path
    transformer_impl: str = choice("auto", "local", "transformer_engine")  # auto: TE on GPU, local on CPU
    recompute_activations: bool = False
    # MoE load-balancing loss weight in the gradient (per layer, Switch-style; 0: the expert load is only
    # reported, moe/* metrics). RL from a pretrained MoE keeps 0: see docs/decisions.md.
    moe_aux_loss_coeff: float = 0.0
    # MoE routing replay (docs/decisions.md): off; r2 = the update passes of a step reuse the experts the
    # old-log-prob pass chose; r3 = every trainer pass reuses the experts the rollout engine chose.
    moe_routing_replay: str = choice("off", "r2", "r3")
    arch: Optional[ArchConfig] = None

    def check(self, c: Checks) -> None:

        path = os.path.expanduser(self.path)
        if self.path.startswith(BUILTIN_PREFIX) and self.path[len(BUILTIN_PREFIX):] not in BUILTINS:
            c.error("model.path", self.path, "no such built-in model",
                    "use one of " + ", ".join(f"{BUILTIN_PREFIX}{n}" for n in BUILTINS))
        elif local_model_path(self.path) and not os.path.isdir(path):
            c.error("model.path", self.path, "no such model directory on this machine",
                    "give a Hugging Face model directory (config.json + safetensors), a hub id 'org/name', or "
                    "one of " + ", ".join(f"{BUILTIN_PREFIX}{n}" for n in BUILTINS))
        elif local_model_path(self.path) and not os.path.isfile(os.path.join(path, "config.json")):
            c.error("model.path", self.path, "a directory without config.json is not a Hugging Face model",
                    "give the directory that holds config.json and the safetensors (e.g. an `mcpo export` output)")
        elif local_model_path(self.path) and self.tokenizer is None and not has_tokenizer(path):
            c.error("model.path", self.path,
                    f"the model directory has no tokenizer (none of {', '.join(TOKENIZER_MARKER_FILES)})",
                    "set model.tokenizer to a directory or hub id with its tokenizer")
        if self.tokenizer and local_model_path(self.tokenizer) and not has_tokenizer(self.tokenizer):
            c.error("model.tokenizer", self.tokenizer,
                    f"no tokenizer there (none of {', '.join(TOKENIZER_MARKER_FILES)})",
                    "give a directory with tokenizer files, a hub id, or null to use model.path's tokenizer")
        if self.moe_aux_loss_coeff < 0:
            c.error("model.moe_aux_loss_coeff", self.moe_aux_loss_coeff, "must be >= 0", "use 0 (report only)")
        self._check_routing_replay(c)
        if c.cuda is False:
            if self.transformer_impl == "transformer_engine":
                c.error("model.transformer_impl", "transformer_engine", "requires CUDA, which is not available here",
                        "use model.transformer_impl=auto or local")
            if c.cfg.rollout.engine == "torch" and self.dtype == "bf16":
                c.warn("model.dtype=bf16 on CPU is slow; use model.dtype=auto (fp32 on CPU)")

    def _check_routing_replay(self, c: Checks) -> None:
        """Replay needs experts to route, and R3 an engine that reports the experts it chose."""
        mode = self.moe_routing_replay
        if mode == "off":
            return
        if c.shape is not None and not c.shape.is_moe:
            c.error("model.moe_routing_replay", mode,
                    f"needs a mixture-of-experts model; {c.shape.source} has no experts", "use off")
        r = c.cfg.rollout
        if mode != "r3" or r.engine != "vllm":
            return
        # vLLM returns routed experts from its GPU model runner only, and only with prefix caching
        if c.cuda is False:
            c.error("model.moe_routing_replay", mode,
                    "rollout.engine=vllm returns the experts it routed each token to only on GPUs (its CPU build "
                    "cannot)", "use r2, or rollout.engine=torch on CPU")
        elif not r.enable_prefix_caching:
            c.error("model.moe_routing_replay", mode,
                    "with rollout.engine=vllm needs rollout.enable_prefix_caching=true (vLLM returns routed experts "
                    "only with prefix caching)", "set rollout.enable_prefix_caching=true, or use r2")
