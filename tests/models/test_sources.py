"""Model sources: HF directories, builtin names, errors, and a build that two ranks race on."""

import threading

import pytest

from mcpo_megatron.models import sources, tiny


def test_hf_dir_is_returned_as_is(tmp_path):
    d = tiny.make_tiny_hf_model("qwen2", tmp_path / "m")
    assert sources.resolve_model_path(d) == d


@pytest.mark.parametrize("path,match", [
    ("builtin:nope", "builtin:smollm2-135m-instruct"),
    ("./missing/dir", "not a HF model directory"),
    ("", "model.path"),
])
def test_bad_paths_explain(path, match):
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        sources.resolve_model_path(path)


def test_dir_without_config_is_rejected(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        sources.resolve_model_path(str(tmp_path))


def test_builtin_build_runs_once_when_ranks_race(tmp_path, monkeypatch):
    monkeypatch.setenv("MCPO_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake_convert(gguf_dir, gguf_name, out_dir, dtype):
        calls.append(out_dir)
        threading.Event().wait(0.3)  # slow enough for the other "rank" to arrive meanwhile
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(sources, "_convert_gguf", fake_convert)
    results = []
    threads = [threading.Thread(target=lambda: results.append(
        sources.resolve_model_path("builtin:smollm2-135m-instruct"))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert results[0] == results[1] == str(tmp_path / "cache" / "smollm2-135m-instruct-float32")
    leftovers = [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_tiny_families_have_their_features():
    assert tiny.tiny_hf_config("llama-tied").tie_word_embeddings is True
    assert tiny.tiny_hf_config("qwen3").head_dim == 16
    with pytest.raises(ValueError, match="family"):
        tiny.tiny_hf_config("gpt2")


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_tiny_builtins_are_made_by_code_and_match_the_shape_table(tmp_path, monkeypatch, name):
    """builtin:tiny-qwen3(-moe) (the recipes' CPU rehearsals) build into the cache with a tokenizer, and the shape
    table that validates configs without the weights says what the builder makes."""
    import dataclasses
    import json

    from mcpo_megatron.config.shapes import KNOWN_SHAPES, _complete, _shape_from_hf
    from mcpo_megatron.models.sources import load_tokenizer

    monkeypatch.setenv("MCPO_CACHE", str(tmp_path))
    path = sources.resolve_model_path(f"builtin:{name}")
    assert path == str(tmp_path / name) and sources.resolve_model_path(f"builtin:{name}") == path
    made = _shape_from_hf(json.loads((tmp_path / name / "config.json").read_text()), "x")
    table = _complete(KNOWN_SHAPES[f"builtin:{name}"], "x")
    assert dataclasses.replace(made, source="") == dataclasses.replace(table, source="")
    tok = load_tokenizer(path, remedy="-")
    assert tok.decode(tok("7 - 3 = 4")["input_ids"]) == "7 - 3 = 4" and len(tok) == table.vocab_size
