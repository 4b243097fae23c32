"""Box-drawn text tables that fit the terminal, for `ogrpo plan`.

Not rich: importing and rendering through rich costs ~0.1 s, a third of what `ogrpo plan` may take on a login
node. Bold/colour only on a terminal (and never with NO_COLOR), so piped output is plain text.
"""

from __future__ import annotations

import os
import shutil
import sys
import textwrap

_STYLES = {"bold": "1", "green": "32", "red": "31", "yellow": "33"}


def styled(text: str, *styles: str, stream=None) -> str:
    stream = stream or sys.stdout
    if os.environ.get("NO_COLOR") or not getattr(stream, "isatty", lambda: False)():
        return text
    codes = ";".join(_STYLES[s] for s in styles)
    return f"\033[{codes}m{text}\033[0m"


def _fit(natural: list[int], floors: list[int], budget: int) -> list[int]:
    """Shrink the widest columns, one character at a time, until the row fits `budget` (never below a floor)."""
    widths = list(natural)
    while sum(widths) > budget:
        shrinkable = [i for i, w in enumerate(widths) if w > floors[i]]
        if not shrinkable:
            break
        widest = max(shrinkable, key=lambda i: widths[i])
        widths[widest] -= 1
    return widths


def box_table(header: list[str], rows: list[list[str]], *, title: str | None = None,
              right: tuple[int, ...] = (), width: int | None = None, stream=None) -> str:
    """The table as text: a header row, cells wrapped at word boundaries so the whole fits `width` columns
    (default: the terminal's, 80 when there is none); columns listed in `right` are right-aligned."""
    width = width or shutil.get_terminal_size((80, 24)).columns
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    n = len(header)
    natural = [max(len(r[i]) for r in cells) for i in range(n)]
    floors = [min(natural[i], max(4, *(len(w) for r in cells for w in r[i].split()))) for i in range(n)]
    widths = _fit(natural, floors, width - (3 * n + 1))

    def lines(row: list[str], bold: bool = False) -> list[str]:
        wrapped = [textwrap.wrap(c, w, break_long_words=True) or [""] for c, w in zip(row, widths)]
        out = []
        for k in range(max(len(w) for w in wrapped)):
            parts = []
            for i, w in enumerate(wrapped):
                text = w[k] if k < len(w) else ""
                text = text.rjust(widths[i]) if i in right else text.ljust(widths[i])
                parts.append(styled(text, "bold", stream=stream) if bold else text)
            out.append("│ " + " │ ".join(parts) + " │")
        return out

    def rule(left: str, mid: str, end: str) -> str:
        return left + mid.join("─" * (w + 2) for w in widths) + end

    out = []
    if title:
        out.append(title.center(sum(widths) + 3 * n + 1).rstrip())
    out.append(rule("┌", "┬", "┐"))
    out += lines(cells[0], bold=True)
    out.append(rule("├", "┼", "┤"))
    for row in cells[1:]:
        out += lines(row)
    out.append(rule("└", "┴", "┘"))
    return "\n".join(out)


def wrap(text: str, width: int | None = None) -> str:
    width = width or shutil.get_terminal_size((80, 24)).columns
    return "\n".join(textwrap.wrap(text, width)) or text
