"""The docs stay true to the code: every `mcpo plan` output shown in docs/scaling.md is what the command prints
today, and every recipe the docs name exists."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from mcpo_megatron import cli

REPO = Path(__file__).resolve().parents[1]
SCALING = REPO / "docs" / "scaling.md"


def _plan_blocks() -> list[tuple[str, str]]:
    """(command, shown output) for each '### `mcpo plan ...`' section of docs/scaling.md."""
    text = SCALING.read_text()
    blocks = re.findall(r"^### `(mcpo plan [^`]+)`\n(.*?)(?=^#)", text, re.MULTILINE | re.DOTALL)
    assert blocks, "docs/scaling.md shows no `mcpo plan` output"
    return blocks


@pytest.mark.parametrize("command,shown", _plan_blocks(), ids=lambda x: x[:60] if x.startswith("mcpo") else "")
def test_plan_output_in_docs_is_current(command, shown, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    rc = cli.main(shlex.split(command)[1:])
    out = capsys.readouterr().out
    assert rc == 0
    assert [line.rstrip() for line in out.strip().splitlines()] == \
        [line.rstrip() for line in shown.strip().splitlines()], f"regenerate the block of `{command}`"


def test_recipes_named_in_docs_exist():
    names = set()
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        names |= set(re.findall(r"configs/([\w.-]+\.yaml)", doc.read_text()))
    missing = sorted(n for n in names if not (REPO / "configs" / n).is_file())
    assert not missing, missing
