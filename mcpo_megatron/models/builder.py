"""Build the megatron-core ``GPTModel`` chunks of this rank (pipeline stage, virtual stages) from a Hugging Face config."""

from __future__ import annotations

from typing import Any

import torch

from mcpo_megatron.models import megatron_config, registry
from mcpo_megatron.parallel import mcore_compat


def build_gpt_model(
    hf_config: Any,
    *,
    dtype: torch.dtype = torch.float32,
    transformer_impl: str = "auto",
    config_overrides: dict[str, Any] | None = None,
    vp_stage: int | None = None,
    sequence_parallel: bool = False,
):
    """The ``GPTModel`` of this rank's pipeline stage (virtual stage ``vp_stage`` with interleaving).

    ``parallel_state`` must be initialised (``init_distributed``); TP/PP/EP/VPP/CP sizes
    come from it, and whether this is the first / last (virtual) pipeline stage (embedding, output layer).
    Tied models (``tie_word_embeddings``) use
    ``share_embeddings_and_output_weights``: megatron keeps the output layer of the
    last stage equal to the first stage's embedding through its embedding group.
    Logits stay vocab-parallel ([s, b, V/tp]): no rank holds the full vocabulary.
    ``sequence_parallel``: see :class:`~mcpo_megatron.models.megatron_config.ParallelLayout`.

    The returned model carries ``mcpo_hf_config``, ``mcpo_shape``
    (:class:`~mcpo_megatron.models.registry.MegatronShape` at this TP and EP) and
    ``mcpo_transformer_impl`` ("local" or "transformer_engine") for the weight
    loader and exporter; ``vp_stage`` is megatron's own attribute.
    """
    from megatron.core import parallel_state as ps

    mcore_compat.require_supported()
    mcore_compat.fill_missing_te_names()
    layout = megatron_config.ParallelLayout.from_parallel_state(sequence_parallel=sequence_parallel)
    if layout.vpp and vp_stage is None:
        raise ValueError(f"virtual pipeline size {layout.vpp}: build each chunk with its vp_stage "
                         "(build_model_chunks)")
    if not layout.vpp and vp_stage not in (None, 0):
        raise ValueError(f"vp_stage={vp_stage} without a virtual pipeline")
    vp_stage = vp_stage if layout.vpp else None
    impl = megatron_config.resolve_impl(transformer_impl)
    config = megatron_config.transformer_config(hf_config, layout, dtype=dtype, transformer_impl=impl,
                                                **(config_overrides or {}))
    model = mcore_compat.gpt_model_class()(
        config=config,
        transformer_layer_spec=megatron_config.block_spec(hf_config, config, transformer_impl=impl, vp_stage=vp_stage),
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        parallel_output=True,
        vp_stage=vp_stage,
        **megatron_config.gpt_model_kwargs(hf_config),
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    model.mcpo_hf_config = hf_config
    model.mcpo_shape = registry.megatron_shape(hf_config, layout.tp, layout.ep)
    model.mcpo_transformer_impl = impl
    return model


def build_model_chunks(hf_config: Any, **kwargs) -> list:
    """This rank's model chunks: one per virtual pipeline stage (one without interleaving).

    Chunk ``i`` holds the layers of virtual stage ``i`` of this pipeline rank; megatron's
    interleaved schedule runs them in turn.  ``kwargs`` go to :func:`build_gpt_model`.
    """
    from megatron.core import parallel_state as ps

    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    if vpp == 1:
        return [build_gpt_model(hf_config, **kwargs)]
    return [build_gpt_model(hf_config, vp_stage=i, **kwargs) for i in range(vpp)]


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
    """Global indices of the decoder layers held by ``model`` (this pipeline stage / virtual stage)."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    model = unwrap(model)
    offset = get_transformer_layer_offset(model.config, vp_stage=getattr(model, "vp_stage", None))
    return range(offset, offset + len(model.decoder.layers))


def expert_offset(model) -> int:
    """Global index of the first expert held by this rank (0 for dense models)."""
    from megatron.core import parallel_state as ps

    shape = unwrap(model).mcpo_shape
    return ps.get_expert_model_parallel_rank() * shape.num_local_experts if shape.is_moe else 0
