"""A vLLM model's weights as the reshard plan writes them (:class:`~mcpo_megatron.rollout.weights.target.WeightTarget`).

vLLM keeps most unquantized weights in the checkpoint layout of its rank's shard (fused ``qkv_proj`` and
``gate_up_proj`` rows, column shards, padded vocabulary rows, fused experts ``w13_weight`` / ``w2_weight``), and a
weight update can write them **in place**. Where a layer turns its weights into another form after loading, the
plan writes a persistent **staging** tensor in the checkpoint layout instead, and the layer's own post-processing
runs on it after the update (``finish``), as after vLLM's first load. Per layer (:func:`classify`):

* RMSNorm weights, and embeddings (``VocabParallelEmbedding``, ``ParallelLMHead``) with the unquantized method:
  in place. On vLLM's CPU build an LM head is also packed into a oneDNN matrix, which is re-packed once after the
  update (a tied head shares the embedding's tensor: one write, one re-pack; the embedding's own packed copy is
  never used, as lookups read the tensor).
* unquantized linear layers: in place on GPUs; on the CPU build, whose post-processing packs the weight into a
  oneDNN matrix and drops the tensor, through staging and a re-pack (biases stay in place).
* unquantized fused experts: in place on GPUs with the Triton kernels (their runtime format is the checkpoint's);
  on the CPU build through staging, then the experts' padding and prepacking.

Any other layer (quantized methods, other MoE kernels, vLLM's expert parallelism, added vocabulary) makes
:func:`weight_target` return None with the reason logged, and the update takes the HF stream through vLLM's
layerwise reload (:mod:`~mcpo_megatron.rollout.engines.vllm.transfer`).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from mcpo_megatron.rollout.weights.target import WeightTarget

log = logging.getLogger(__name__)

IN_PLACE, STAGED_LINEAR, STAGED_EXPERTS = "in_place", "staged_linear", "staged_experts"


def classify(module: torch.nn.Module, param: str, *, cpu: bool) -> str | None:
    """How the plan writes ``module``'s parameter ``param`` (see the module docstring); None: it cannot."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import (UnquantizedEmbeddingMethod,
                                                                     VocabParallelEmbedding)

    method = getattr(module, "quant_method", None)
    if isinstance(module, RMSNorm) and param == "weight":
        return IN_PLACE
    if isinstance(module, VocabParallelEmbedding) and isinstance(method, UnquantizedEmbeddingMethod):
        return IN_PLACE if module.num_added_embeddings == 0 else None
    if isinstance(module, LinearBase) and isinstance(method, UnquantizedLinearMethod):
        if getattr(module, "allow_rocm_bf16x3_router_gemm", False):
            return None  # keeps a split copy of its weight
        if param == "bias" or not cpu:
            return IN_PLACE
        return STAGED_LINEAR if not getattr(module, "_cpu_skip_gemm_dispatch", False) else IN_PLACE
    if type(method) is UnquantizedFusedMoEMethod and param in ("w13_weight", "w2_weight"):
        if getattr(module, "expert_map", None) is not None:
            return None  # vLLM's expert parallelism: a rank holds some experts (not in the plan's layouts)
        if cpu:
            return STAGED_EXPERTS
        backend = getattr(method, "unquantized_backend", None)
        return IN_PLACE if getattr(backend, "name", None) in ("TRITON", "BATCHED_TRITON") else None
    return None


def weight_target(model: torch.nn.Module, hf_config, *, replica: int) -> WeightTarget | None:
    """The :class:`WeightTarget` of this rank's vLLM ``model`` (vLLM's tensor-parallel group initialised), or None
    when some layer cannot be written by the plan (logged). ``replica``: this engine's rollout replica."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.platforms import current_platform

    from mcpo_megatron.models.registry import UnsupportedModelError, megatron_shape
    from mcpo_megatron.rollout.weights.layouts import EngineLayout, engine_tensor_shapes
    from mcpo_megatron.rollout.weights.transfer import dtype_name

    cpu = current_platform.is_cpu()
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())  # a tied head shares the embedding's parameter: listed once
    embed = modules.get("model.embed_tokens")
    if embed is None or not hasattr(embed, "num_embeddings_padded"):
        return _unsupported("the model has no vocabulary-parallel model.embed_tokens")
    try:
        layout = EngineLayout("vllm", dtype_name(embed.weight.dtype), tp=get_tensor_model_parallel_world_size(),
                              tp_rank=get_tensor_model_parallel_rank(), vocab_padded=embed.num_embeddings_padded,
                              replica=replica)
        expected = engine_tensor_shapes(megatron_shape(hf_config), layout)
    except (UnsupportedModelError, ValueError) as e:
        return _unsupported(str(e))
    tensors: dict[str, torch.Tensor] = {}
    linear: list[tuple[torch.nn.Module, torch.Tensor]] = []
    experts: dict[str, tuple[torch.nn.Module, dict[str, torch.Tensor]]] = {}
    for key, shape in expected.items():
        module_name, name = key.rsplit(".", 1)
        module, param = modules.get(module_name), params.get(key)
        how = classify(module, name, cpu=cpu) if module is not None and param is not None else None
        if how is None:
            method = type(getattr(module, "quant_method", None)).__name__
            return _unsupported(f"{key} ({type(module).__name__}, {method})")
        if how == IN_PLACE:
            if tuple(param.shape) != shape or not param.is_contiguous():
                return _unsupported(f"{key} has shape {tuple(param.shape)}, the plan expects {shape}")
            tensors[key] = param
            continue
        staging = torch.empty(shape, dtype=param.dtype, device=param.device)
        tensors[key] = staging
        if how == STAGED_LINEAR:
            linear.append((module, staging))
        else:
            experts.setdefault(module_name, (module, {}))[1][name] = staging
    heads = [m for m in modules.values() if isinstance(m, ParallelLMHead)] if cpu else []
    return WeightTarget(layout, tensors, finish=_finish(linear, experts, heads))


def _unsupported(reason: str) -> None:
    log.warning("the weight update takes vLLM's layerwise reload (the HF stream): the reshard plan cannot write %s",
                reason)
    return None


def _finish(linear, experts, heads) -> Callable[[], None]:
    """After the plan's writes: each staged layer post-processed from its staging tensors, as at vLLM's first load
    (CPU: oneDNN packing of linear layers, the experts' padding and prepacking), and each LM head re-packed."""

    @torch.no_grad()
    def finish() -> None:
        from vllm.model_executor.utils import replace_parameter

        for module, staging in linear:
            # The packed matrix is built from the tensor the layer holds; the layer then drops it again.
            module.weight = torch.nn.Parameter(staging, requires_grad=False)
            module.quant_method.process_weights_after_loading(module)
        for module, staged in experts.values():
            for name, staging in staged.items():
                replace_parameter(module, name, staging)
            module.quant_method.moe_kernel.fused_experts.process_weights_after_loading(module)
        for head in heads:
            head.quant_method.process_weights_after_loading(head)

    return finish
