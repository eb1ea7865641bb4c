"""metrics.jsonl after a crash or a full disk: a torn last record is dropped with a warning naming the file, by
every reader (the trainer's resume, mcpo report, the run summary, mcpo plan / demo); a bad record anywhere else is
an error naming the file and the line."""

import json

import pytest

from mcpo_megatron import accounting
from mcpo_megatron.report.runs import load_run
from mcpo_megatron.trainer.metrics import read_jsonl, truncate_jsonl


def _records(steps):
    return "".join(json.dumps({"step": s, "reward/mean": 0.1 * s, "time/step": 1.0}) + "\n" for s in steps)


def _torn_run(tmp_path, tail='{"step": 4, "reward/me'):
    """A run killed while writing step 4's record: three whole records, then a partial line."""
    path = tmp_path / "metrics.jsonl"
    path.write_text(_records((1, 2, 3)) + tail)
    return path


@pytest.mark.parametrize("tail", ['{"step": 4, "reward/me', '{"step": 4, "rew\n', "\0\0\0\0"])
def test_resume_drops_a_torn_last_record_with_a_warning(tmp_path, tail):
    """The trainer's resume (truncate_jsonl) keeps the steps its checkpoint holds and rewrites a clean file; the
    torn tail may lack its newline, or be the zeros a crashed file system leaves."""
    path = _torn_run(tmp_path, tail)
    with pytest.warns(UserWarning, match=f"{path}: line 4 is a partial record .* dropped"):
        truncate_jsonl(path, 2)
    assert path.read_text() == _records((1, 2))
    with pytest.warns(UserWarning, match="partial record"):
        truncate_jsonl(_torn_run(tmp_path, tail), 3)
    assert path.read_text() == _records((1, 2, 3))


def test_every_reader_drops_a_torn_last_record(tmp_path):
    path = _torn_run(tmp_path)
    with pytest.warns(UserWarning, match=str(path)):
        assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3]  # mcpo plan, mcpo demo
    with pytest.warns(UserWarning, match=str(path)):
        assert [r["step"] for r in load_run(tmp_path).records] == [1, 2, 3]  # mcpo report
    with pytest.warns(UserWarning, match=str(path)):
        summary = json.loads(accounting.write_summary(tmp_path).read_text())
    assert summary["steps"] == 3 and summary["last_step"] == 3


def test_a_bad_record_before_the_last_line_is_an_error_naming_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(_records((1,)) + '{"step": 2, "rew\n' + _records((3,)))
    for read in (read_jsonl, lambda p: truncate_jsonl(p, 3), lambda p: load_run(p.parent)):
        with pytest.raises(ValueError, match=rf"{path}: line 2 is not a JSON record .*only the last line"):
            read(path)
    assert path.read_text().count("\n") == 3  # left as it was, for someone to look at
    path.write_text(_records((1,)) + "[1, 2]\n" + _records((3,)))  # JSON, but not a step record
    with pytest.raises(ValueError, match=rf"{path}: line 2 is not a step record"):
        read_jsonl(path)
