"""Plain-text tables for the terminal and logs, drawn by rich: columns left-aligned two spaces
apart, no borders, no colour and no wrapping (a table in a log stays one line per row)."""

from __future__ import annotations

import io
from collections.abc import Sequence


def render(rows: Sequence[Sequence[str]]) -> str:
    """`rows[0]` is the header. Trailing spaces are stripped from every line."""
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, pad_edge=False, padding=(0, 1), show_edge=False, header_style="")
    for name in rows[0]:
        table.add_column(name, no_wrap=True, overflow="ignore")
    for row in rows[1:]:
        table.add_row(*row)
    out = io.StringIO()
    Console(
        file=out, width=100_000, color_system=None, force_terminal=False, highlight=False
    ).print(table)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines())
