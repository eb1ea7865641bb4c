"""A policy's checkpoint (``step_N/policy``): megatron's distributed checkpoint of the model chunks, the optimizer
(dp-reshardable) and the LR schedule, written and read by every rank (collective).

The model entries are named by :func:`model_sharded_state_dict` for both the full load
(:meth:`MegatronPolicy.load_checkpoint <mcpo_megatron.models.policy.MegatronPolicy.load_checkpoint>`) and the
weights-only one (:func:`load_model_weights`: ``mcpo export``, bare chunks without DDP or optimizer).
"""

from __future__ import annotations

import os

import torch

from mcpo_megatron.parallel import mcore_compat

# Common (non-sharded) checkpoint entries.
_SCHEDULER_KEY = "lr_scheduler"
_OPTIM_SHARDING = {"distrib_optim_sharding_type": "dp_reshardable"}


def model_sharded_state_dict(chunks: list) -> dict:
    """``{"model": ...}`` (one chunk) or ``{"model0": ..., "model1": ...}`` (virtual pipeline, megatron's naming)
    of bare model chunks; the sharded tensors inside carry global layer and expert indices, so the layout can change
    on load."""
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def sharded_state_dict(chunks: list, optimizer, scheduler, *, is_loading: bool = False) -> dict:
    """Model (from the bare chunks), optimizer (dp-reshardable) and scheduler state."""
    model_sd = model_sharded_state_dict(chunks)
    optim_sd = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=dict(_OPTIM_SHARDING))
    return {**model_sd, "optimizer": optim_sd, _SCHEDULER_KEY: scheduler.state_dict()}


def save_state(chunks: list, optimizer, scheduler, directory: str | os.PathLike) -> None:
    """Write the chunks', optimizer's and scheduler's state into ``directory`` (collective). The parameters must be
    the updated ones (``MegatronPolicy.sync_params``)."""
    from megatron.core import dist_checkpointing

    from mcpo_megatron.models.checkpoint_writer import start_checkpoint_writer

    os.makedirs(directory, exist_ok=True)
    start_checkpoint_writer()  # its helper process must outlive a preemption signal
    dist_checkpointing.save(sharded_state_dict(chunks, optimizer, scheduler), str(directory))


def load_state(chunks: list, optimizer, scheduler, directory: str | os.PathLike) -> None:
    """Restore the chunks, the optimizer and the scheduler from ``directory`` (collective)."""
    from megatron.core import dist_checkpointing

    _require_checkpoint_dir(directory)
    # torch's Adam (megatron's optimizer without TE or Apex) creates its state lazily, but megatron's loader
    # reads the existing state ('step'): materialise it with a zero update first (the
    # parameters it touches are overwritten by the load below).
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(opt, "_init_optimizer_states_with_dummy_values"):
            opt._init_optimizer_states_with_dummy_values()
    state = dist_checkpointing.load(sharded_state_dict(chunks, optimizer, scheduler, is_loading=True),
                                    str(directory))
    _load_model_state(chunks, state)
    # The fp32 optimizer state must be copied without autograd tracking.
    with torch.no_grad():
        optimizer.load_state_dict(state["optimizer"])
    mcore_compat.restore_adam_steps(optimizer, state["optimizer"])
    scheduler.load_state_dict(state[_SCHEDULER_KEY])


def load_model_weights(chunks: list, directory: str | os.PathLike) -> None:
    """Load the model weights of a policy checkpoint (``step_N/policy``) into bare model chunks (collective).

    The chunks may be built at another expert-parallel or virtual pipeline size than the checkpoint's, and in
    another dtype (values are cast on load: a bf16 checkpoint loads exactly into fp32 chunks). Nothing of the
    optimizer is read, so the chunks need no DDP wrapper or optimizer (``mcpo export`` loads its chunks so)."""
    from megatron.core import dist_checkpointing

    _require_checkpoint_dir(directory)
    state = dist_checkpointing.load(model_sharded_state_dict(chunks), str(directory))
    _load_model_state(chunks, state)


def _load_model_state(chunks: list, state: dict) -> None:
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    for key, chunk in zip(keys, chunks):
        chunk.load_state_dict(state[key])


def _require_checkpoint_dir(directory: str | os.PathLike) -> None:
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"policy checkpoint directory {directory} does not exist")
