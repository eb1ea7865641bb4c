"""The CPU shim keeps torch's device context working (transformers loads models under torch.device("meta"))."""

import subprocess
import sys

CODE = """
import torch
from mcpo_megatron.parallel.cpu_shim import apply_cpu_shim
apply_cpu_shim()
with torch.device("meta"):
    a, b = torch.zeros(2), torch.tensor([1.0])
c = torch.zeros(2, device="cuda")
print(a.device.type, b.device.type, c.device.type)
"""


def test_meta_device_context_survives_the_shim():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["meta", "meta", "cpu"]
