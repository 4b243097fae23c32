"""`ogrpo bench rewards`: the old paths run in a child that is stopped at the cap, and the CLI entry exists."""

from __future__ import annotations

import psutil

from ogrpo.bench.rewards import code_format_text, format_text, run_old


def _children_for(case: str) -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if case in (p.info["cmdline"] or []) and "--old" in (p.info["cmdline"] or [])]


def test_inputs_have_the_issue_sizes():
    assert len(code_format_text(8192)) == 8192 and len(format_text(128 * 1024)) == 128 * 1024


def test_old_path_is_timed_or_stopped_at_the_cap():
    assert isinstance(run_old("format:2048", cap_s=60), float)  # a small input finishes
    # open-r1's format regex needs seconds on 256 KiB (quadratic): stopped after 0.5 s, and its child is gone
    assert run_old("format:262145", cap_s=0.5) is None
    assert _children_for("format:262145") == []


def test_cli_refuses_a_cap_that_stops_nothing_in_one_line(run_cli, tmp_path):
    csv = tmp_path / "r.csv"
    for cap in ("0", "-1", "nan"):
        proc = run_cli("bench", "rewards", "--old-cap", cap, "--csv", str(csv))
        assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
        assert "--old-cap" in proc.stderr and "Traceback" not in proc.stderr
    assert not csv.exists()  # refused before anything ran
