"""Text tables of `ogrpo plan`: they fit the width they are given and stay plain off a terminal."""

from __future__ import annotations

import io

from ogrpo.render.boxes import box_table, styled


class _Tty(io.StringIO):
    def isatty(self):
        return True


ROWS = [["precision", "bf16", "A40 (sm_86) has bf16: no loss scaling needed"],
        ["NCCL_P2P_DISABLE", "1", "A40 boxes are PCIe: the trainer to vLLM NCCL broadcast can hang with P2P"]]


def test_table_fits_the_width_and_keeps_every_word():
    for width in (120, 60, 40):
        text = box_table(["setting", "value", "why"], ROWS, width=width, stream=io.StringIO())
        lines = text.splitlines()
        assert max(len(line) for line in lines) <= width
        assert len({len(line) for line in lines}) == 1  # every line the same width: the box is closed
        words = " ".join(line.strip("│ ") for line in lines).split()
        for word in " ".join(" ".join(r) for r in ROWS).split():
            assert word in words


def test_right_aligned_columns_and_title():
    text = box_table(["role", "GiB"], [["trainer", "1.5"], ["vLLM server", "12.0"]], right=(1,), title="memory",
                     width=80, stream=io.StringIO())
    lines = text.splitlines()
    assert lines[0].strip() == "memory"
    assert "│     1.5 │" not in text and "│  1.5 │" in text and "│ 12.0 │" in text


def test_styles_only_on_a_terminal(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert styled("fits", "bold", "green", stream=io.StringIO()) == "fits"
    assert styled("fits", "bold", "green", stream=_Tty()) == "\033[1;32mfits\033[0m"
    monkeypatch.setenv("NO_COLOR", "1")
    assert styled("fits", "bold", stream=_Tty()) == "fits"
