"""Build a megatron-core ``GPTModel`` (this pipeline stage) from a Hugging Face config."""

from __future__ import annotations

from typing import Any

import torch

from mcpo_megatron.models import registry


def build_gpt_model(
    hf_config: Any,
    *,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    dtype: torch.dtype = torch.float32,
    transformer_impl: str = "auto",
    parallel_output: bool = True,
    config_overrides: dict[str, Any] | None = None,
):
    """The ``GPTModel`` of this rank's pipeline stage (virtual pipeline size 1).

    ``parallel_state`` must be initialised (``init_distributed``); TP/PP sizes
    come from it.  ``pre_process`` / ``post_process`` default to whether this is
    the first / last pipeline stage.  Tied models (``tie_word_embeddings``) use
    ``share_embeddings_and_output_weights``: megatron keeps the output layer of
    the last stage equal to the first stage's embedding through its embedding
    group.  ``parallel_output=True`` leaves logits vocab-parallel ([s, b, V/tp]).

    The returned model carries ``mcpo_hf_config``, ``mcpo_shape``
    (:class:`~mcpo_megatron.models.registry.ModelShape`) and
    ``mcpo_transformer_impl`` ("local" or "transformer_engine") for the weight
    loader and exporter.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    if ps.get_virtual_pipeline_model_parallel_world_size() not in (None, 1):
        raise ValueError("build_gpt_model supports virtual pipeline size 1 only")
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    impl = registry.resolve_impl(transformer_impl)
    config = registry.transformer_config(
        hf_config, tp=tp, pp=pp, dtype=dtype, transformer_impl=impl, **(config_overrides or {})
    )
    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage(ignore_virtual=True)
    if post_process is None:
        post_process = ps.is_pipeline_last_stage(ignore_virtual=True)
    model = GPTModel(
        config=config,
        transformer_layer_spec=registry.layer_spec(hf_config, transformer_impl=impl),
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=parallel_output,
        **registry.gpt_model_kwargs(hf_config),
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    model.mcpo_hf_config = hf_config
    model.mcpo_shape = registry.model_shape(hf_config, tp)
    model.mcpo_transformer_impl = impl
    return model


def unwrap(model):
    """The bare ``GPTModel`` inside DDP / Float16Module wrappers."""
    while not hasattr(model, "mcpo_shape") and hasattr(model, "module"):
        model = model.module
    if not hasattr(model, "mcpo_shape"):
        raise TypeError(
            f"{type(model).__name__} was not built by build_gpt_model (no mcpo_shape attribute)"
        )
    return model


def stage_layers(model) -> range:
    """Global indices of the decoder layers held by ``model`` (this pipeline stage)."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    model = unwrap(model)
    offset = get_transformer_layer_offset(model.config)
    return range(offset, offset + len(model.decoder.layers))
