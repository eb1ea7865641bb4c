"""Model sources: HF directories, builtin names, errors, and a build that two ranks race on."""

import threading

import pytest

from mcpo_megatron.models import sources


def test_hf_dir_is_returned_as_is(tmp_path):
    d = sources.make_tiny_hf_model("qwen2", tmp_path / "m")
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
    assert sources.tiny_hf_config("llama-tied").tie_word_embeddings is True
    assert sources.tiny_hf_config("qwen3").head_dim == 16
    with pytest.raises(ValueError, match="family"):
        sources.tiny_hf_config("gpt2")
