"""parallel/mcore_compat.py on the installed megatron-core (0.16.1 in `make test`, 0.19.x in `make test-current`): the
version is read without importing megatron, an unsupported release is refused by name, and each difference it
handles behaves as on the other release. The checkpoint writer's queue: tests/models/test_checkpoint_writer.py."""

from __future__ import annotations

import inspect
import logging
import subprocess
import sys

import pytest

from mcpo_megatron.parallel import mcore_compat


def test_version_is_read_without_importing_megatron():
    code = ("import sys; from mcpo_megatron.parallel import mcore_compat as m; v = m.installed_version(); "
            "print(v, m.require_supported(), 'megatron.core' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    version, *_, imported = out.stdout.split()
    import megatron.core

    assert version == megatron.core.__version__.split("+")[0] and imported == "False"


@pytest.mark.parametrize("version,release", [("0.16.1", (0, 16, 1)), ("0.19.2", (0, 19, 2)),
                                             ("0.19.0rc1", (0, 19, 0)), ("0.18", (0, 18, 0))])
def test_release_of_a_version_string(version, release):
    assert mcore_compat.release(version) == release == mcore_compat.check_version(version)


def test_an_unsupported_release_is_refused_naming_it_the_range_and_the_fix():
    with pytest.raises(RuntimeError) as e:
        mcore_compat.check_version("0.20.1")
    assert "megatron-core 0.20.1 is installed" in str(e.value) and ">= 0.16.1, < 0.20" in str(e.value)
    assert "pip install 'megatron-core>=0.16.1,<0.20'" in str(e.value)
    with pytest.raises(ValueError, match="'main' is not of the form MAJOR.MINOR"):
        mcore_compat.release("main")


def test_gpt_deprecation_record_is_dropped_and_every_other_record_passes(caplog):
    from megatron.core.models.gpt import gpt_model

    assert mcore_compat.gpt_model_class() is mcore_compat.gpt_model_class() is gpt_model.GPTModel
    logger = logging.getLogger(gpt_model.__name__)
    assert logger.filters.count(mcore_compat._GPT_FILTER) == 1  # installed once however many models are built
    deprecation = [line for line in inspect.getsource(gpt_model.GPTModel.__init__).splitlines()
                   if "IS DEPRECATED" in line]
    if mcore_compat.require_supported() >= (0, 19, 0):  # the record 0.19 logs is the one the filter drops
        assert deprecation and deprecation[0].strip().startswith(f'"{mcore_compat._GPT_DEPRECATION}')
    else:
        assert deprecation == []
    with caplog.at_level(logging.INFO, logger=logger.name):
        logger.warning("GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes, no new features.")
        logger.warning("another warning of gpt_model")
    assert [r.getMessage() for r in caplog.records] == ["another warning of gpt_model"]


def test_router_without_transformer_engine_takes_the_torch_path():
    mcore_compat.fill_missing_te_names()
    from megatron.core.transformer.moe import moe_utils

    assert moe_utils.te_general_gemm is None


def _as_megatron_loads_it(step_value: float, n: int = 3):
    """A distributed optimizer's torch AdamW as megatron-core's load leaves it on its torch-Adam path: one step tensor
    shared by every parameter (0.16.1 optimizer/distrib_optimizer.py 817-825, 0.19.2 1024-1032)."""
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(n)]
    opt = object.__new__(DistributedOptimizer)  # only what the repair reads: the wrapped torch optimizer
    opt.optimizer = torch.optim.AdamW(params)
    shared = torch.tensor(step_value)
    for p in params:
        opt.optimizer.state[p] = {"step": shared, "exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2)}
    return opt, shared


def test_adams_step_is_repaired_on_megatrons_torch_adam_path_whatever_the_device(monkeypatch):
    """Keyed on megatron's own test (HAVE_APEX_OR_TE), not on CUDA: with CUDA present and neither TE nor Apex, each
    parameter gets its own step, the checkpoint's; with TE's or Apex's FusedAdam nothing is touched."""
    import torch
    from megatron.core.optimizer import distrib_optimizer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    checkpoint = {"optimizer": {"param_groups": [{"step": 7}, {"step": 7}]}}

    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", False)
    assert mcore_compat.uses_torch_adam()
    opt, shared = _as_megatron_loads_it(1.0)
    mcore_compat.restore_adam_steps(opt, checkpoint)
    steps = [s["step"] for s in opt.optimizer.state.values()]
    assert len({id(s) for s in steps}) == 3 and all(s is not shared for s in steps)
    assert [float(s) for s in steps] == [7.0] * 3 and all(s.dtype == torch.float32 for s in steps)

    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)
    assert not mcore_compat.uses_torch_adam()
    opt, shared = _as_megatron_loads_it(1.0)
    mcore_compat.restore_adam_steps(opt, checkpoint)
    assert all(s["step"] is shared for s in opt.optimizer.state.values()) and float(shared) == 1.0


def test_adam_steps_that_disagree_across_param_groups_are_refused(monkeypatch):
    from megatron.core.optimizer import distrib_optimizer

    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", False)
    opt, _ = _as_megatron_loads_it(1.0)
    with pytest.raises(RuntimeError, match=r"hold different steps \[3, 4\]"):
        mcore_compat.restore_adam_steps(opt, {"optimizer": {"param_groups": [{"step": 3}, {"step": 4}]}})
