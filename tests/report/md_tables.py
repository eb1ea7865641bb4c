"""Reading the cells of `mcpo report`'s Markdown tables back in tests (an escaped ``\\|`` stays inside its cell)."""

from __future__ import annotations

import re


def table_rows(md: str, header_start: str) -> list[list[str]]:
    """Rows (cells) of every table whose header line starts with ``header_start``."""
    rows, inside = [], False
    for line in md.splitlines():
        if line.startswith(header_start):
            inside = True
            continue
        if inside and line.startswith("|---"):
            continue
        if inside and line.startswith("|"):
            rows.append([c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))])
        else:
            inside = False
    return rows


def rows_by_label(md: str, header_start: str) -> dict[str, list[str]]:
    """The same rows keyed by their first cell (a repeated label gets ``#<index>``)."""
    out: dict[str, list[str]] = {}
    for cells in table_rows(md, header_start):
        out[cells[0] if cells[0] not in out else f"{cells[0]}#{len(out)}"] = cells
    return out
