"""`mcpo export`'s parity probe without process groups: the Megatron side's logits are given (megatron_logits
replaced), the transformers side is a tiny model with the character tokenizer. The probe scores every next token
of every probe text, and a NaN anywhere fails it."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from mcpo_megatron.commands import export
from mcpo_megatron.models import parity


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from mcpo_megatron.models.tiny import make_tiny_model_with_tokenizer

    return make_tiny_model_with_tokenizer(tmp_path_factory.mktemp("probe") / "model")


def probe(monkeypatch, model_dir, edit, tp=1, sequence_parallel=False):
    """probe_parity with the transformers logits, edited by ``edit``, standing in for megatron's."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    lengths = []

    def fake_megatron_logits(chunks, ids):
        lengths.append(ids.shape[1])
        with torch.no_grad():
            return edit(hf(ids).logits.float())

    monkeypatch.setattr(parity, "megatron_logits", fake_megatron_logits)
    chunk = SimpleNamespace(config=SimpleNamespace(tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel))
    return export.probe_parity([chunk], model_dir, model_dir, compare=True), lengths


def test_identical_logits_pass_and_every_text_is_probed(monkeypatch, model_dir):
    worst, lengths = probe(monkeypatch, model_dir, lambda x: x)
    assert worst == 0.0 and lengths == [len(t) for t in export.PROBE_TEXTS]  # one token per character


def test_sequence_parallel_probes_are_padded_to_a_multiple_of_tp(monkeypatch, model_dir):
    worst, lengths = probe(monkeypatch, model_dir, lambda x: x, tp=4, sequence_parallel=True)
    assert worst == 0.0 and lengths == [-(-len(t) // 4) * 4 for t in export.PROBE_TEXTS]


def test_a_nan_or_a_wrong_logit_fails(monkeypatch, model_dir):
    def one_nan(logits):
        logits[0, 5, 7] = math.nan
        return logits

    def shifted(logits):
        logits[0, -2, :] += torch.linspace(0, 1, logits.shape[-1])
        return logits

    assert math.isnan(probe(monkeypatch, model_dir, one_nan)[0])
    assert probe(monkeypatch, model_dir, shifted)[0] > 1e-2
