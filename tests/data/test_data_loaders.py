"""Prompt loaders: dedupe counts on the shipped hub-schema test files, canonicalisation, templates."""

import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
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
    with pytest.raises(ValueError, match=re.escape(f"{bad}:1: the row has columns ['text']")):
        load_prompts("jsonl", path=str(bad))


GOOD = '{"problem": "What is 1 + 1?", "answer": "2"}'
VERL_NULL = ('{"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "data_source": "s", '
             '"reward_model": {"ground_truth": null}}')


@pytest.mark.parametrize("second_line, problem", [
    ('{"text": "no problem column"}', "the row has columns ['text']; expected the verl schema"),
    ('{"problem": "What is 1 + 2?", "answer": 3', "not valid JSON (Expecting ',' delimiter at column 42)"),
    ('[1, 2]', "a row must be a JSON object (the problem and its answer), not list: [1, 2]"),
    ('"What is 1 + 2?"', "a row must be a JSON object (the problem and its answer), not str: 'What is 1 + 2?'"),
    (VERL_NULL, "reward_model.ground_truth is null: every row needs its gold answer"),
    ('{"problem": "What is 1 + 2?", "answer": null}', "answer is null: every row needs its gold answer"),
])
def test_a_bad_row_is_named_by_file_and_line(tmp_path, second_line, problem):
    """Line numbers count every line of the file (blank ones too) from 1: the bad row here is on line 3."""
    path = tmp_path / "set.jsonl"
    path.write_text(f"{GOOD}\n\n{second_line}\n")
    with pytest.raises(ValueError) as e:
        load_prompts("jsonl", path=str(path))
    assert str(e.value).startswith(f"{path}:3: {problem}"), str(e.value)


def test_non_utf8_file_names_the_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(GOOD.encode() + b"\n" + '{"problem": "Combien font 2 + 2 ?", "answer": "4", "note": "é"}'
                     .encode("latin-1") + b"\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: not UTF-8 text (byte 0xe9); save the file as UTF-8")):
        load_prompts("jsonl", path=str(path))
    # a UTF-8 byte-order mark is read as one
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + GOOD.encode() + b"\n")
    assert [r.ground_truth for r in load_prompts("jsonl", path=str(bom))[0]] == ["2"]


def test_folder_array_and_parquet_rows_are_named(tmp_path):
    folder = tmp_path / "sets"
    folder.mkdir()
    (folder / "a_train.jsonl").write_text(GOOD + "\n")
    (folder / "b_train.jsonl").write_text(GOOD.replace("1 + 1", "1 + 3") + "\n" + VERL_NULL + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{folder / 'b_train.jsonl'}:2: reward_model.ground_truth is null")):
        load_prompts("aime_2024", path=str(folder))
    array = tmp_path / "set.json"
    array.write_text(f"[{GOOD},\n 7]")
    with pytest.raises(ValueError, match=re.escape(f"{array}: item 2: a row must be a JSON object")):
        load_prompts("jsonl", path=str(array))
    table = tmp_path / "set.parquet"
    pq.write_table(pa.Table.from_pylist([{"problem": "What is 1 + 1?", "answer": "2"},
                                         {"problem": "What is 1 + 2?", "answer": None}]), table)
    with pytest.raises(ValueError, match=re.escape(f"{table}: row 2: answer is null")):
        load_prompts("parquet", path=str(table))


def test_numeric_answers_keep_their_digits(tmp_path):
    """JSON numbers are gold answers as written: a float holds 17 significant digits, so 1.0e30 used to become
    1000000000000000019884624838656 and 123456789012345678901234567890.0 lost its last 13 digits."""
    big = "123456789012345678901234567890"
    path = tmp_path / "numbers.jsonl"
    rows = [f'{{"problem": "p1", "answer": {big}}}', f'{{"problem": "p2", "answer": {big}.0}}',
            '{"problem": "p3", "answer": 1.0e30}', '{"problem": "p4", "answer": 27.0}',
            '{"problem": "p5", "answer": 12.5}', '{"problem": "p6", "answer": 0.1}',
            f'{{"prompt": [{{"role": "user", "content": "p7"}}], "reward_model": {{"ground_truth": {big}.00}}}}']
    path.write_text("\n".join(rows) + "\n")
    records, report = load_prompts("jsonl", path=str(path))
    assert [r.ground_truth for r in records] == [big, big, "1" + "0" * 30, "27", "12.5", "0.1", big]
    assert records[1].extra["raw_answer"] == f"{big}.0"
    assert report.canonicalised == 4


def test_record_type():
    r = PromptRecord(uid="u", problem="p", prompt=[{"role": "user", "content": "p"}], ground_truth="1",
                     data_source="s", extra={})
    assert r.to_dict()["prompt"][0]["content"] == "p"
