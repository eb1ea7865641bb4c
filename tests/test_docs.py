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


PACKAGE_DIRS = "|".join(p.name for p in (REPO / "mcpo_megatron").iterdir() if (p / "__init__.py").is_file())
# a module of the package as the docs name it: rollout/weights/plan.py, or with a name in it, rollout/weights/plan.X
MODULE_REF = re.compile(rf"(?<![\w/.-])(?:mcpo_megatron/)?((?:{PACKAGE_DIRS})/[\w/]+?)(?:\.py\b|\.(?=[A-Za-z_]))")
CITATION = re.compile(r"`{1,2} \d")
TEST_REF = re.compile(r"(?<![\w/.-])(tests/[\w/]+\.py)\b")


def test_modules_and_tests_named_in_docs_exist():
    """The docs and the package's docstrings name modules by path (``rollout/weights/plan.choose_source``) and
    tests by file: each must exist, so that a move of a module cannot leave a reader looking for it."""
    missing = []
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "mcpo_megatron").rglob("*.py"))]
    for path in files:
        for ln, line in enumerate(path.read_text().splitlines(), 1):
            for m in MODULE_REF.finditer(line):
                if CITATION.match(line, m.end()):  # a pinned release's file and lines (docs/verification.md)
                    continue
                module = REPO / "mcpo_megatron" / m.group(1)
                if not (module.with_suffix(".py").is_file() or (module / "__init__.py").is_file()):
                    missing.append(f"{path.relative_to(REPO)}:{ln}: {m.group(1)}")
            for m in TEST_REF.finditer(line):
                if not (REPO / m.group(1)).is_file():
                    missing.append(f"{path.relative_to(REPO)}:{ln}: {m.group(1)}")
    assert not missing, "\n".join(missing)
