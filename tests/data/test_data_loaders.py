"""Prompt loaders: dedupe counts on the shipped hub-schema test files, canonicalisation, templates."""

from pathlib import Path

import pytest

from mcpo_megatron.data import DAPO_TEMPLATE, PromptRecord, canonical_answer, format_prompt, load_prompts

import make_test_files as mk

FILES = Path(__file__).resolve().parent / "files"


def test_dapo_template_is_the_spec_text_verbatim():
    expected = (
        "Solve the following math problem step by step. The last line of your response should be of the form "
        "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\nWhat is 1+1?\n\n"
        'Remember to put your answer on its own line after "Answer:".'
    )
    assert format_prompt("What is 1+1?", "dapo") == expected
    assert DAPO_TEMPLATE.format(problem="What is 1+1?") == expected
    with pytest.raises(ValueError, match="template='chatml' is not one of"):
        format_prompt("x", "chatml")


@pytest.mark.parametrize("spec,name", [("dapo_math_17k", "dapo_math_mini.parquet"), ("jsonl", "dapo_math_mini.jsonl")])
def test_dapo_dedupe_drops_repeats_and_conflicting_prompts(spec, name):
    records, rep = load_prompts(spec, path=str(FILES / name))
    block = len(mk.DAPO_BLOCK)
    assert rep.rows_read == block * mk.DAPO_REPEATS == 35
    assert rep.conflicting_dropped == 1
    assert rep.unique_prompts == block - 1 == 6
    assert rep.duplicates_dropped == block * (mk.DAPO_REPEATS - 1) == 28
    assert rep.rows_read == rep.unique_prompts + rep.duplicates_dropped + rep.conflicting_dropped
    assert [r.problem for r in records] == [p for p, _ in mk.DAPO_BLOCK if p != mk.DAPO_CONFLICT[0]]
    assert [r.ground_truth for r in records] == [a for p, a in mk.DAPO_BLOCK if p != mk.DAPO_CONFLICT[0]]
    # the stored prompt is the DAPO message of the hub row, rebuilt from the bare problem
    assert records[0].prompt == mk.DAPO_PREFIX + mk.DAPO_BLOCK[0][0] + mk.DAPO_SUFFIX
    assert all(r.data_source == "math_dapo" for r in records)
    assert len({r.uid for r in records}) == len(records)


def test_aime_2024_dedupes_32_copies():
    records, rep = load_prompts("aime_2024", path=str(FILES / "aime_2024_mini.parquet"), split="train")
    assert (rep.rows_read, rep.unique_prompts, rep.duplicates_dropped) == (96, 3, 93)
    assert [r.ground_truth for r in records] == [a for _, a in mk.AIME_PROBLEMS]


def test_amc_answers_are_canonicalised():
    records, rep = load_prompts("amc_2023", path=str(FILES / "amc_2023_mini.jsonl"))
    assert [r.ground_truth for r in records] == ["27", "12.5", "3", "7"]
    assert rep.canonicalised == 2
    assert records[0].extra["raw_answer"] == "27.0"
    assert records[0].problem == "What is $3^3$?"


def test_aime_2025_flat_schema_and_template_choice():
    records, rep = load_prompts("aime_2025", path=str(FILES / "aime_2025_mini.jsonl"), template="boxed")
    assert rep.unique_prompts == 2
    assert records[1].prompt == format_prompt("Find $5!$ divided by $4$.", "boxed")
    assert records[1].extra["id"] == "I-2"


def test_canonical_answer():
    assert canonical_answer("27.0") == ("27", True)
    assert canonical_answer(27.0) == ("27", True)
    assert canonical_answer("-3.00") == ("-3", True)
    assert canonical_answer("12.5") == ("12.5", False)
    assert canonical_answer("\\frac{1}{2}") == ("\\frac{1}{2}", False)
    assert canonical_answer(" 7 ") == ("7", True)


def test_num_samples_is_a_seeded_subset():
    a, rep = load_prompts("aime_2024", path=str(FILES / "aime_2024_mini.parquet"), num_samples=2, seed=3)
    b, _ = load_prompts("aime_2024", path=str(FILES / "aime_2024_mini.parquet"), num_samples=2, seed=3)
    assert [r.uid for r in a] == [r.uid for r in b] and len(a) == 2 and rep.returned == 2


def test_bad_specs_and_paths_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="spec='gsm8k' is not a known prompt set"):
        load_prompts("gsm8k")
    with pytest.raises(ValueError, match="needs path="):
        load_prompts("jsonl")
    with pytest.raises(FileNotFoundError, match="neither a local file"):
        load_prompts("aime_2024", path=str(tmp_path / "missing.parquet"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no problem column"}\n')
    with pytest.raises(ValueError, match="row 0 has columns"):
        load_prompts("jsonl", path=str(bad))


def test_record_type():
    r = PromptRecord(uid="u", problem="p", prompt=[{"role": "user", "content": "p"}], ground_truth="1",
                     data_source="s", extra={})
    assert r.to_dict()["prompt"][0]["content"] == "p"
