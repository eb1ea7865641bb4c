"""The megatron-core range and the ``gpu`` extra's pins against the installed megatron-core and its own metadata.

Each lane installs the megatron-core that ``pip install -e '.[gpu]'`` picks for its Python (0.16.1 on 3.11, 0.19.x on
3.12), so here the extra's Transformer Engine pin for this Python must be the range that megatron-core declares in
its metadata. 0.16.1 declares one (its ``dev`` extra: >=2.9.0a0,<2.12.0); 0.17 and later name Transformer Engine
without a version, and the release their repository builds and tests with stands in (``BUILT_WITH_TE``). Transformer
Engine itself is never installed here (it needs CUDA).
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from mcpo_megatron.parallel import mcore_compat

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
TE = "transformer-engine"

# The Transformer Engine each megatron-core release that declares none was built and tested with: its repository's
# pyproject.toml at the release tag ([tool.uv.sources] / [[tool.uv.dependency-metadata]]: 2.17.1 for 0.19.0 and
# 0.19.1).
BUILT_WITH_TE = {(0, 19): "2.17.1"}

# The Gated DeltaNet's kernel packages each release imports (megatron/core/ssm/gated_delta_net.py in 0.16.1:
# fla and causal_conv1d; gated_delta_net/common.py in 0.19: fla only, its convolution included).
GDN_KERNELS = {(0, 16): {"flash-linear-attention", "causal-conv1d"}, (0, 19): {"flash-linear-attention"}}


def _requirements(specs: list[str], python: str) -> dict[str, Requirement]:
    """Name -> requirement of ``specs`` whose markers hold on Python ``python`` (one per name, else a failure)."""
    env = {"python_version": python, "python_full_version": f"{python}.0", "extra": "gpu"}
    out: dict[str, Requirement] = {}
    for spec in specs:
        req = Requirement(spec)
        if req.marker is None or req.marker.evaluate(env):
            assert req.name not in out, f"two requirements of {req.name} apply on Python {python}: {spec}"
            out[req.name] = req
    return out


def _installed_te_requirements() -> list[Requirement]:
    reqs = [Requirement(r) for r in importlib.metadata.requires("megatron-core") or []]
    return [r for r in reqs if r.name == TE]


def test_the_range_is_the_compat_seams():
    (base,) = [Requirement(r) for r in PROJECT["dependencies"] if Requirement(r).name == "megatron-core"]
    assert base.specifier == SpecifierSet(">=0.16.1,<0.20")
    lo, hi = ".".join(map(str, mcore_compat.MINIMUM)), ".".join(map(str, mcore_compat.BELOW))
    assert base.specifier == SpecifierSet(f">={lo},<{hi}")
    for inside in ("0.16.1", "0.17.1", "0.18.2", "0.19.0", "0.19.2"):
        assert Version(inside) in base.specifier and mcore_compat.check_version(inside)
    for outside in ("0.15.3", "0.16.0", "0.20.0"):
        assert Version(outside) not in base.specifier
        with pytest.raises(RuntimeError, match=rf"megatron-core {outside} is installed; .* supports megatron-core "
                                               r">= 0.16.1, < 0.20"):
            mcore_compat.check_version(outside)


def test_the_installed_megatron_core_is_the_gpu_extras_for_this_python():
    python = ".".join(platform.python_version_tuple()[:2])
    installed = importlib.metadata.version("megatron-core")
    assert mcore_compat.installed_version() == installed  # the imported package is the installed distribution
    pick = _requirements(PROJECT["optional-dependencies"]["gpu"], python)["megatron-core"]
    assert Version(installed) in pick.specifier, (
        f"this lane runs megatron-core {installed}, but the gpu extra installs {pick.specifier} on Python {python}")
    requires_python = importlib.metadata.metadata("megatron-core")["Requires-Python"]
    assert Version(platform.python_version()) in SpecifierSet(requires_python)


def test_gpu_extra_pins_the_transformer_engine_megatron_core_declares():
    python = ".".join(platform.python_version_tuple()[:2])
    pinned = _requirements(PROJECT["optional-dependencies"]["gpu"], python)[TE]
    declared = _installed_te_requirements()
    assert declared, "the installed megatron-core names no transformer-engine in its metadata"
    installed = importlib.metadata.version("megatron-core")
    ranges = {r.specifier for r in declared if r.specifier}
    if ranges:
        assert ranges == {pinned.specifier}, (
            f"megatron-core {installed} declares {TE} {sorted(map(str, ranges))}; pyproject's gpu extra pins "
            f"{pinned.specifier} on Python {python}")
    else:
        built = BUILT_WITH_TE[mcore_compat.release(installed)[:2]]
        assert pinned.specifier.contains(built, prereleases=True), (
            f"megatron-core {installed} was built with {TE} {built}; pyproject's gpu extra pins {pinned.specifier}")
        assert not pinned.specifier.contains("2.20.2") and len(pinned.specifier) == 2, (
            "pin a bounded range, not whatever is newest")
    for r in declared:  # the CUDA build megatron-core asks Transformer Engine for (core_cu13: torch's CUDA 13)
        assert r.extras <= pinned.extras, f"megatron-core asks for {TE}{sorted(r.extras)}; the gpu extra {pinned}"


def test_gpu_extra_pins_the_gated_deltanet_kernels_megatron_core_declares():
    installed = mcore_compat.installed_version()
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    pinned = _requirements(PROJECT["optional-dependencies"]["gpu"], python)
    declared: dict[str, set[SpecifierSet]] = {}
    for r in map(Requirement, importlib.metadata.requires("megatron-core") or []):
        if r.name in GDN_KERNELS[(0, 16)]:
            declared.setdefault(r.name, set()).add(r.specifier)
    wanted = GDN_KERNELS[Version(installed).release[:2]]
    for name in wanted:
        assert declared[name] == {pinned[name].specifier}, (
            f"megatron-core {installed} declares {name} {sorted(map(str, declared[name]))}; pyproject's gpu extra "
            f"pins {pinned[name].specifier}")
    assert set(pinned) & GDN_KERNELS[(0, 16)] == wanted


@pytest.mark.parametrize("python", ["3.11", "3.12", "3.13"])
def test_gpu_extra_resolves_one_megatron_core_and_one_transformer_engine_per_python(python):
    reqs = _requirements(PROJECT["optional-dependencies"]["gpu"], python)
    want = {"3.11": ("==0.16.1", ">=2.9.0a0,<2.12.0")}.get(python, (">=0.19,<0.20", ">=2.17.1,<2.18"))
    assert (reqs["megatron-core"].specifier, reqs[TE].specifier) == tuple(map(SpecifierSet, want))
    assert str(reqs["vllm"].specifier) == "==0.32.0"
    assert str(reqs["flash-linear-attention"].specifier) == "~=0.4.0"
    assert ("causal-conv1d" in reqs) == (python == "3.11")


def test_the_current_lane_names_test_files_that_exist():
    """`make test-current` runs an explicit list (CURRENT_TESTS in the Makefile): a renamed test must not drop out."""
    import re

    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    (listed,) = re.findall(r"^CURRENT_TESTS \?= (.*)$", text, re.MULTILINE)
    paths = listed.split()
    assert len(paths) >= 15 and len(set(paths)) == len(paths)
    assert [p for p in paths if not (REPO / p).is_file()] == []
