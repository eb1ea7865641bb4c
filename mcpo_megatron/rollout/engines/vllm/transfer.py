"""In-process weight updates of a colocated vLLM engine, as a vLLM weight-transfer backend.

vLLM's weight-transfer API gives every update a lifecycle on the worker:
``start_weight_update`` -> ``update_weights(chunk)`` per chunk -> ``finish_weight_update``.
vLLM's own backends (NCCL, IPC) move tensors between processes; in the colocated SPMD
design the engine lives in the training process (``external_launcher``), so this
backend receives the tensors themselves.  Like vLLM's checkpoint-format backends it
runs vLLM's layerwise reload: ``start`` puts every layer on the meta device and wraps
its weight loaders, each chunk goes through ``model.load_weights`` (Hugging Face
names, full tensors; vLLM fuses q/k/v and gate/up and cuts its TP shard), a layer is
materialised and post-processed (e.g. the CPU build's oneDNN weight packing) as soon as
all of its weights have arrived, and ``finish`` handles whatever was not complete.
A fused layer may span chunks: it waits, buffered, until its last part arrives.

Tied layers.  With ``tie_word_embeddings`` the LM head shares the embedding's
parameter and no checkpoint tensor names it, so the reload never loads or processes
it.  On GPUs that is harmless (the head reads the shared, updated tensor).  vLLM's CPU
build, however, packs the head's weight into a oneDNN matrix when it is processed, and
that packed copy would keep serving the *old* embedding: every log-prob after an update
of the embedding would be wrong (measured: max |diff| 6.6 against transformers after
perturbing every tensor of SmolLM2-135M).  :func:`refresh_tied_layers` re-runs the
(unquantized) post-processing of such layers after each update, which re-packs them
from the shared tensor; it is a no-op on GPUs.

Fused experts on CPU.  The same holds for MoE layers, inside vLLM.  At first load the
CPU build's unquantized fused-MoE method zero-pads each expert's width up to its
grouped-GEMM kernel's alignment (32 on x86 and Arm) and prepacks ``w13_weight`` / ``w2_weight``
into the kernel's blocked layout.  On a weight update vLLM takes a shortcut meant for
GPUs (``UnquantizedFusedMoEMethod._setup_kernel`` once a kernel exists): it copies the
loaded, checkpoint-layout tensors into the existing parameters and skips that
padding and prepacking.  So an expert width the kernel needs no padding for (e.g. 128)
gets row-major weights read as blocked ones (measured: max |diff| 2.5 after an update
of every tensor), and a padded one (48 -> 64) cannot even be copied back ("The size
of tensor a (128) must match the size of tensor b (96)").  :func:`repacked_cpu_experts`
makes those layers' post-processing during an update end with the experts' own
step (pad, prepack), as at first load, before the reload copies the result into the
kernel's tensors; GPU kernels keep checkpoint-shaped weights and are left alone.

Expected warnings.  At every update vLLM's reload logs "<Layer>: Failed to load weights"
for each layer that holds tensors no checkpoint names, and puts the layer's own tensors
back: the tied head (re-packed above) and buffer-only layers such as rotary embeddings
(tables computed from the config).  For those layers the warning is dropped; for a layer
with parameters of its own it still shows, since there it means a weight was not sent.

This module imports vLLM; :func:`register` must run before the engine is built.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

log = logging.getLogger(__name__)

BACKEND = "mcpo_colocated"
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


@dataclass
class ColocatedInitInfo(WeightTransferInitInfo):
    """Nothing to set up: the tensors are already in this process."""


@dataclass
class ColocatedUpdateInfo(WeightTransferUpdateInfo):
    """One chunk of an update: ``(hf_name, tensor)`` pairs, full (unsharded) tensors."""

    weights: list = field(default_factory=list)


class ColocatedWeightTransferEngine(WeightTransferEngine[ColocatedInitInfo, ColocatedUpdateInfo]):
    init_info_cls = ColocatedInitInfo
    update_info_cls = ColocatedUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: ColocatedInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.unsent_layer_classes = unsent_layer_classes(self.model)
        self.update_scope = contextlib.ExitStack()
        self.update_scope.enter_context(repacked_cpu_experts(self.model))
        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: ColocatedUpdateInfo) -> None:
        self.model.load_weights(iter(update_info.weights))

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        try:
            with expected_reload_warnings(self.unsent_layer_classes):
                finalize_layerwise_reload(self.model, self.model_config)
        finally:
            self.update_scope.close()
        refresh_tied_layers(self.model)

    def shutdown(self) -> None:
        pass


def tied_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Unquantized embedding-like layers whose parameters all belong to an earlier module
    (tied LM heads), with their names."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    owner: dict[int, str] = {}
    tied = []
    for name, module in model.named_modules():
        params = list(module.parameters(recurse=False))
        if not params:
            continue
        shared = all(id(p) in owner for p in params)
        for p in params:
            owner.setdefault(id(p), name)
        if shared and isinstance(getattr(module, "quant_method", None), UnquantizedEmbeddingMethod):
            tied.append((name, module))
    return tied


@torch.no_grad()
def refresh_tied_layers(model: torch.nn.Module) -> list[str]:
    """Re-run the post-processing of the tied layers (re-packs them from the shared,
    updated tensor); returns their names.  See the module docstring."""
    refreshed = []
    for name, module in tied_layers(model):
        method: Any = module.quant_method
        method.process_weights_after_loading(module)
        refreshed.append(name)
    return refreshed


def cpu_prepacked_experts(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Unquantized fused-MoE layers run by vLLM's CPU grouped-GEMM experts (which pad and
    prepack their weights when processed), with their names; none on GPUs."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return []
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    found = []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        if isinstance(method, UnquantizedFusedMoEMethod) and isinstance(getattr(kernel, "fused_experts", None),
                                                                        CPUUnquantizedExperts):
            found.append((name, module))
    return found


@contextlib.contextmanager
def repacked_cpu_experts(model: torch.nn.Module):
    """While open, the post-processing of every :func:`cpu_prepacked_experts` layer runs its
    experts' padding and prepacking after vLLM's own weight-update path, which skips them
    (see the module docstring).  Yields the layers' names."""
    layers = cpu_prepacked_experts(model)
    for _, layer in layers:
        method = layer.quant_method
        experts = method.moe_kernel.fused_experts

        def process_weights_after_loading(moe_layer, _method=method, _experts=experts):
            type(_method).process_weights_after_loading(_method, moe_layer)
            _experts.process_weights_after_loading(moe_layer)

        method.process_weights_after_loading = process_weights_after_loading  # instance attribute, removed below
    try:
        yield [name for name, _ in layers]
    finally:
        for _, layer in layers:
            del layer.quant_method.process_weights_after_loading


def unsent_layer_classes(model: torch.nn.Module) -> set[str]:
    """Class names of the layers an update never sends tensors for: tied layers and layers
    with buffers but no parameters of their own (rotary tables)."""
    names = {type(m).__name__ for _, m in tied_layers(model)}
    for module in model.modules():
        buffers_only = not list(module.parameters(recurse=False)) and bool(list(module.buffers(recurse=False)))
        if buffers_only:
            names.add(type(module).__name__)
    return names


class _DropFailedLoadWarning(logging.Filter):
    def __init__(self, layer_classes: set[str]):
        super().__init__()
        self.layer_classes = layer_classes

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and bool(record.args)
                    and record.args[0] in self.layer_classes)


@contextlib.contextmanager
def expected_reload_warnings(layer_classes: set[str]):
    """Drop vLLM's "<Layer>: Failed to load weights" for ``layer_classes`` (see the module
    docstring: the layers an update never sends tensors for)."""
    logger = logging.getLogger(RELOAD_LOGGER)
    filt = _DropFailedLoadWarning(set(layer_classes))
    logger.addFilter(filt)
    try:
        yield
    finally:
        logger.removeFilter(filt)


def register() -> None:
    """Make :data:`BACKEND` known to vLLM's weight-transfer factory (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, ColocatedWeightTransferEngine)
    except ValueError:  # already registered in this process
        pass
