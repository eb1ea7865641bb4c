"""The megatron-core releases this package runs on, and every difference between them, in one place.

Supported: 0.16.1 (the last release that installs on Python 3.11) through 0.19.x (Python 3.12 and 3.13). Tested:
0.16.1 on Python 3.11 (``make test``) and 0.19.x on Python 3.12 (``make test-current``); docs/scaling.md
("Software versions") lists the combinations and docs/decisions.md says why a range. Every other module calls
megatron-core's API as 0.16.1 and 0.19 share it, and comes here where they differ:

* the async checkpoint writer's results queue (``dist_checkpointing.strategies.filesystem_async``): 0.17 renamed
  its getter ``_get_write_results_queue`` to ``get_write_results_queue``; both read the module variable
  ``_results_queue`` (:func:`set_checkpoint_results_queue` and the two beside it);
* ``GPTModel`` logs "GPTModel IS DEPRECATED" from 0.19 on, at every model it builds (one per pipeline chunk, one
  more for a reference model). Its successor, ``HybridModel``, puts attention and MLP in separate layers, so the
  weight names, the HF mapping and the checkpoints would all change; 0.19 still builds ``GPTModel`` and fixes its
  bugs, so the policy stays on it and :func:`gpt_model_class` drops that one log record (docs/decisions.md);
* without Transformer Engine, 0.16.1's MoE router reads ``moe_utils.te_general_gemm``, a name only its TE import
  defines (``NameError``); 0.17 and later set it to None there (:func:`fill_missing_te_names`);
* without Transformer Engine's or Apex's FusedAdam (megatron-core then runs torch's Adam, on any device), every
  release in the range loads Adam's ``step`` wrongly; :func:`restore_adam_steps` repairs it after each load.

:func:`require_supported` refuses any other release, naming it, the range and what to install; it runs before the
first megatron-core call of a process (``init_distributed``, ``build_gpt_model``).
"""

from __future__ import annotations

import functools
import logging
import re
from pathlib import Path

import torch

# The supported releases: from MINIMUM through every 0.19.x.
MINIMUM = (0, 16, 1)
BELOW = (0, 20)
SUPPORTED = "megatron-core >= 0.16.1, < 0.20 (tested: 0.16.1 on Python 3.11, 0.19.x on Python 3.12)"

_GPT_DEPRECATION = "GPTModel IS DEPRECATED"


def installed_version() -> str:
    """The version of the megatron-core that ``import megatron.core`` would find (a source checkout on ``PYTHONPATH``
    included, which has no installed distribution to ask), read from its ``package_info.py`` without importing
    it: megatron.core's import pulls in most of the library, which the CPU shim must patch first."""
    import importlib.util

    spec = importlib.util.find_spec("megatron")
    roots = list(spec.submodule_search_locations or ()) if spec is not None else []
    for root in roots:
        info = Path(root) / "core" / "package_info.py"
        if info.is_file():
            fields = dict(re.findall(r"^(MAJOR|MINOR|PATCH|PRE_RELEASE)\s*=\s*['\"]?([^'\"\n]*)['\"]?\s*$",
                                     info.read_text(), re.M))
            if {"MAJOR", "MINOR", "PATCH"} <= fields.keys():
                return f"{fields['MAJOR']}.{fields['MINOR']}.{fields['PATCH']}{fields.get('PRE_RELEASE', '')}"
            raise RuntimeError(f"{info}: no MAJOR / MINOR / PATCH version fields; is this megatron-core?")
    raise RuntimeError(f"megatron-core is not installed (no megatron/core/package_info.py on the import path); "
                       f"mcpo-megatron needs {SUPPORTED}: pip install -e . installs it")


def release(version: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a megatron-core version string: ``0.19.0rc1+abc`` -> (0, 19, 0)."""
    match = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        raise ValueError(f"megatron-core version {version!r} is not of the form MAJOR.MINOR[.PATCH]")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def check_version(version: str) -> tuple[int, int, int]:
    """``version``'s release when it is supported; otherwise a RuntimeError naming it, the range and the fix."""
    rel = release(version)
    if MINIMUM <= rel and rel[:2] < BELOW:
        return rel
    raise RuntimeError(
        f"megatron-core {version} is installed; mcpo-megatron supports {SUPPORTED}. Install a release in that "
        f"range (`pip install 'megatron-core>=0.16.1,<0.20'`, or `pip install -e '.[gpu]'` for the tested one) "
        f"or put such a checkout first on PYTHONPATH")


@functools.cache
def require_supported() -> tuple[int, int, int]:
    """The installed megatron-core's release, checked once per process (:func:`check_version`)."""
    return check_version(installed_version())


# --------------------------------------------------------------------------- the async checkpoint writer


def _results_queue_getter(rel: tuple[int, int, int]) -> str:
    return "_get_write_results_queue" if rel < (0, 17, 0) else "get_write_results_queue"


def _filesystem_async():
    """megatron's async writer module, checked to hold the queue variable and this release's getter."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    getter = _results_queue_getter(require_supported())
    if not hasattr(filesystem_async, "_results_queue") or not callable(getattr(filesystem_async, getter, None)):
        raise RuntimeError(
            f"megatron-core {installed_version()}: dist_checkpointing.strategies.filesystem_async has no "
            f"_results_queue / {getter}(); its checkpoint writer changed, update parallel/mcore_compat.py")
    return filesystem_async


def has_checkpoint_results_queue() -> bool:
    """Whether megatron's async checkpoint writer has its results queue (made at its first save, or set here)."""
    return _filesystem_async()._results_queue is not None


def set_checkpoint_results_queue(queue) -> None:
    """Make ``queue`` the one megatron's async checkpoint writer hands its results through (before its first save:
    it keeps the first queue it has for the life of the process)."""
    module = _filesystem_async()
    if module._results_queue is not None:
        raise RuntimeError("megatron's checkpoint writer already has its results queue; set it before the first save")
    module._results_queue = queue


def checkpoint_results_queue():
    """The queue megatron's writer uses at its next save, as its own getter returns it (creating one if none)."""
    module = _filesystem_async()
    return getattr(module, _results_queue_getter(require_supported()))()


# --------------------------------------------------------------------------- GPTModel


class _DropGPTDeprecation(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_GPT_DEPRECATION)


_GPT_FILTER = _DropGPTDeprecation()


def gpt_model_class():
    """megatron's ``GPTModel``, with 0.19's deprecation record (logged at every construction) filtered out of its
    module's logger; every other record of that logger still passes."""
    from megatron.core.models.gpt import gpt_model

    logger = logging.getLogger(gpt_model.__name__)
    if _GPT_FILTER not in logger.filters:
        logger.addFilter(_GPT_FILTER)
    return gpt_model.GPTModel


# --------------------------------------------------------------------------- without Transformer Engine


def fill_missing_te_names() -> None:
    """0.16.1 without Transformer Engine: ``moe_utils`` imports ``te_general_gemm`` only when TE imports, yet the
    router's linear tests it unconditionally (``NameError``). None selects its torch matmul path, as 0.17 and
    later do themselves."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


# --------------------------------------------------------------------------- Adam without Apex / Transformer Engine


def uses_torch_adam() -> bool:
    """Whether megatron-core's distributed optimizer runs torch's Adam: neither Transformer Engine's nor Apex's
    FusedAdam imports. This is megatron's own test, ``HAVE_APEX_OR_TE`` in ``optimizer/distrib_optimizer.py``
    (0.16.1 lines 21-36, 0.19.2 lines 20-35), which picks its state-dict and load paths; the device plays no part, and
    ``transformer_impl`` neither (an installed TE gives FusedAdam to the local layer spec too)."""
    from megatron.core.optimizer import distrib_optimizer

    return not distrib_optimizer.HAVE_APEX_OR_TE


def restore_adam_steps(optimizer, optim_state: dict) -> None:
    """After ``optimizer.load_state_dict(optim_state)`` (``optim_state``: the loaded ``optimizer`` entry of its
    sharded state dict), give each parameter of megatron's torch-Adam path a ``step`` tensor of its own holding the
    checkpoint's step; a no-op with TE's or Apex's FusedAdam, which keep the step in their param groups.

    On the torch-Adam path (:func:`uses_torch_adam`) ``DistributedOptimizer.load_state_dict`` gets the step wrong
    twice over. It gives every parameter the SAME step tensor (0.16.1 ``optimizer/distrib_optimizer.py`` 817-825,
    0.19.2 1024-1032), which torch's ``Optimizer.load_state_dict`` keeps shared (``torch/optim/optimizer.py``
    794-797) and torch's AdamW then increments once per parameter (``torch/optim/adam.py`` 681-686, one
    ``_foreach_add_`` over the list of steps). Then its dp_reshardable loader copies into that tensor each
    parameter's step as the placeholder state built for loading holds it (the step is a ``LocalNonpersistentObject``
    there, 0.16.1 1664-1667, copied at 940; 0.19.2 1953-1956 and 1225). Either changes Adam's bias correction from
    the first resumed update on."""
    if not uses_torch_adam():
        return
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    states = [optim_state] if len(parts) == 1 else [optim_state[i] for i in range(len(parts))]
    for part, state in zip(parts, states):
        if not isinstance(part, DistributedOptimizer):
            continue  # megatron's other optimizers load torch's own state dict, one step per parameter
        steps = {group["step"] for group in state["optimizer"]["param_groups"]}
        if len(steps) != 1:
            raise RuntimeError(f"the checkpoint's Adam param groups hold different steps {sorted(steps)}; "
                               "megatron-core writes one step for all of them")
        step = float(steps.pop())
        for param_state in part.optimizer.state.values():
            if "step" in param_state:
                param_state["step"] = torch.tensor(step, dtype=torch.float32, device=param_state["step"].device)
