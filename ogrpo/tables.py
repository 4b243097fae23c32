"""The one plain-text table of the CLI's reports (benchmarks, `kernels check-cuda`, the GPU report): a header,
a rule, one line a row, columns padded to their widest cell. `ogrpo plan`'s terminal tables wrap to the
terminal's width instead (ogrpo/render/boxes.py). Pure: no rich, so a report costs no import time."""

from __future__ import annotations


def format_table(header: list[str], rows: list[list], right: tuple[int, ...] | None = None) -> str:
    """`right`: the columns aligned right (default: all but the first, for numbers); the rest align left."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    right = tuple(range(1, len(widths))) if right is None else right

    def line(cells) -> str:
        return "  ".join(str(c).rjust(w) if i in right else str(c).ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])
