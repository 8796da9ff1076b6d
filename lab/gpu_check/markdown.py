"""Markdown tables, as the tools print them and write them into their summaries: called as
``markdown.table(...)`` (the report modules' own ``markdown_table`` functions lay out their
results' rows)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["table"]


def table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A Markdown table: ``header``'s cells, then one line per row (cells as ``str`` gives
    them, with ``|`` escaped so that a cell's text cannot split the row)."""

    def line(cells: Sequence[object]) -> str:
        return "| " + " | ".join(str(cell).replace("|", "\\|") for cell in cells) + " |"

    return "\n".join([line(header), "|" + "---|" * len(header), *map(line, rows)])
