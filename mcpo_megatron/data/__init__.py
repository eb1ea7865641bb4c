"""Prompt sets (the paper's hub sets with dedupe, offline generators), templates and the sampler."""

from mcpo_megatron.data.hub import HUB_NAMES, canonical_answer
from mcpo_megatron.data.loaders import SPECS, load_prompts
from mcpo_megatron.data.records import LoadReport, PromptRecord
from mcpo_megatron.data.sampler import PromptSampler
from mcpo_megatron.data.templates import DAPO_TEMPLATE, TEMPLATES, build_prompt_token_ids, format_prompt

__all__ = [
    "DAPO_TEMPLATE",
    "HUB_NAMES",
    "SPECS",
    "TEMPLATES",
    "LoadReport",
    "PromptRecord",
    "PromptSampler",
    "build_prompt_token_ids",
    "canonical_answer",
    "format_prompt",
    "load_prompts",
]
