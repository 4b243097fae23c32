"""A quiet run: `make demo`'s command, on the embedded default, shows O-GRPO's lines, the training bar and the
stage table, and nothing from a library; what the libraries printed is in the trainer's log, complete.
A trainer that fails still shows its one-line error and points at the log (ogrpo/trainer/quiet.py)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
STEPS = 2

# O-GRPO's own line formats on a local run (plan summary, plan changes, notes, the supervisor, the stage table
# and what follows it). Anything else, but the training bar, is a library talking to the user.
OURS = [re.compile(p) for p in (
    r"plan: ", r"  \w[\w ]*: ",                         # the plan's summary and its indented role lines
    r"change: ", r"note: ", r"error: ", r"running locally in ", r"\[ogrpo supervise\] ",
    r" *Stage profile \(", r"[┏┃┡│└]",                  # the stage table (rich)
    r"peak RSS ", r"padding computed \(pad_share\): ", r"idle share of the step: ", r"run directory: ",
    r"ogrpo: ",                                          # the trainer's own notices (server mode's weight push)
)]
# the training bar only: tqdm's bar over the run's steps, no description (loading/saving bars have one)
BAR = re.compile(rf"^ *\d+%\|[^|]*\| *\d+/{STEPS} \[")


def _foreign(text: str) -> list[str]:
    """Lines (and carriage-return segments: a bar redraws with \\r) that are not O-GRPO's nor the training bar."""
    out = []
    for seg in re.split(r"[\r\n]", text):
        if seg.strip() and not BAR.match(seg) and not any(p.match(seg) for p in OURS):
            out.append(seg)
    return out


def _alive_under(job_dir: Path) -> list[str]:
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if str(job_dir) in " ".join(proc.info["cmdline"] or []) and proc.pid != os.getpid():
                found.append(f"{proc.pid}: {' '.join(proc.info['cmdline'])[:200]}")
        except (psutil.Error, TypeError):
            continue
    return found


def _demo_command() -> list[str]:
    """The command `make demo` runs (after setup), read from the Makefile so the two cannot drift apart."""
    text = (REPO / "Makefile").read_text()
    recipe = text.split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    line = next(ln.strip().lstrip("@") for ln in recipe.splitlines()[1:] if "$(OGRPO)" in ln)
    return line.replace("$(OGRPO)", str(Path(sys.executable).with_name("ogrpo"))).split()


@pytest.mark.slow
@pytest.mark.integration
def test_demo_shows_only_ogrpo_lines_and_the_log_keeps_the_rest(tmp_path):
    cmd = _demo_command()
    assert cmd[1:] == ["submit", "--backend", "local", "--gpus", "cpu", "--config", "tiny"], cmd
    # the same recipe at its smallest: two steps, a checkpoint at each (transformers' save bar runs too)
    recipe = yaml.safe_load((REPO / "ogrpo" / "recipes" / "tiny.yaml").read_text())
    recipe.update({"max_steps": STEPS, "save_steps": 1, "save_total_limit": 1})
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(recipe))
    job = tmp_path / "job"
    cmd[cmd.index("tiny")] = str(cfg)
    env = {k: v for k, v in os.environ.items() if k not in ("OGRPO_CONSOLE", "OGRPO_STEP_LOG", "KINETO_LOG_LEVEL")}
    env["COLUMNS"] = "400"  # rich wraps at 80 columns off a terminal: the run directory's long path stays one line
    proc = subprocess.run([*cmd, "--output", str(job)], capture_output=True, text=True, timeout=600, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    shown = proc.stdout + proc.stderr
    assert _foreign(shown) == [], "library output on the terminal:\n" + "\n".join(_foreign(shown))
    # what the user came for is there: the bar to its end, the stage table, where the run is
    assert re.search(rf"100%\|[^|]*\| {STEPS}/{STEPS} \[", proc.stdout), proc.stdout[-2000:]
    assert "Stage profile" in proc.stdout and f"run directory: {job / 'run'}" in proc.stdout

    log = (job / "run" / "logs" / "trainer.log").read_text(errors="replace")
    # the libraries' notices, each kept in the log: accelerate's launcher (a child process), DeepSpeed's logger,
    # transformers' loading and saving bars
    for notice in ("values were not passed to `accelerate launch`", "Setting accelerator to CPU",
                   "Loading weights", "Writing model shards"):
        assert notice in log, f"{notice!r} missing from the trainer's log"
    # vLLM's import notice is not: the demo generates in the trainer, which then never imports vLLM
    assert "Triton is installed, but doesn't include CPU backend" not in log
    # ... and O-GRPO's own lines too: the log is the whole record
    assert "Stage profile" in log and f"run directory: {job / 'run'}" in log
    # the profiler's memory tracking says nothing, anywhere
    assert "profiler_start" not in log and "profiler_start" not in shown
    # a summary of the libraries' warnings, if any, names the log it left them in
    for line in shown.splitlines():
        if "warning" in line and "from libraries" in line:
            assert str(job / "run" / "logs" / "trainer.log") in line

    roles = job / "run" / "roles"
    from ogrpo.launch.procs import group_members

    for record in roles.glob("*.json"):
        assert group_members(json.loads(record.read_text())["pid"]) == [], f"{record.stem} left processes behind"
    assert _alive_under(job) == []


def test_a_failing_trainer_shows_its_error_and_points_at_the_log(tmp_path):
    """The trainer's own error line reaches the terminal through the supervisor's echo; the log keeps it."""
    from ogrpo.jobspec import JobSpec, Step
    from ogrpo.launch.supervisor import Supervisor

    job = tmp_path / "job"
    missing = tmp_path / "missing.yaml"
    spec = JobSpec(name="t", job_dir=str(job), steps=[Step(
        role="trainer", nodes=[0], gpus=[], ntasks=1,
        argv=[sys.executable, "-m", "ogrpo.train", "--config", str(missing), "--output-dir", str(job / "run")])])
    echo, out = io.BytesIO(), io.StringIO()
    t0 = time.monotonic()
    result = Supervisor(spec, {"job_dir": str(job)}, follow="trainer", echo=echo, out=out, poll_s=0.1).run()
    assert result.rc == 2, result.message
    shown = echo.getvalue().decode()
    error = [ln for ln in shown.splitlines() if ln.startswith("error: ")]
    assert len(error) == 1 and str(missing) in error[0], shown
    assert _foreign(shown) == [], shown
    log_path = job / "run" / "logs" / "trainer.log"
    assert f"log: {log_path}" in out.getvalue()
    assert error[0] in log_path.read_text()
    assert time.monotonic() - t0 < 120


def test_library_output_goes_to_the_log_only(tmp_path):
    """In one process: a library's warning, logger record and print stay in the log; O-GRPO's print, its
    logger's record and a bar it is handed through to_console() reach the console too."""
    lib = tmp_path / "lib"
    (lib / "noisylib").mkdir(parents=True)
    (lib / "noisylib" / "__init__.py").write_text(
        "import logging, sys, warnings\n"
        "log = logging.getLogger('noisylib')\n"
        "log.addHandler(logging.StreamHandler(sys.stdout))\n"
        "def talk():\n"
        "    warnings.warn('noisylib deprecation', UserWarning)\n"
        "    log.warning('noisylib record')\n"
        "    print('noisylib print')\n"
        "    import os; os.write(2, b'noisylib native\\n')\n"
        "def bar():\n"
        "    import tqdm\n"
        "    return tqdm.tqdm(total=3)\n"
        "def own_bar():\n"
        "    b = bar(); b.update(3); b.close()\n")
    code = (
        "__name__ = 'ogrpo.quiet_check'\n"  # this script speaks as an O-GRPO module: who wrote is read by module
        "import logging, sys\n"
        "from ogrpo.trainer import quiet\n"
        "assert quiet.install()\n"
        "import noisylib\n"
        "noisylib.talk()\n"
        "print('ogrpo line')\n"
        "logging.getLogger('ogrpo.test').warning('ogrpo record')\n"
        "with quiet.to_console():\n"
        "    b = noisylib.bar()\n"
        "b.update(3); b.close()\n"
        "noisylib.own_bar()\n"  # a bar the library makes and draws itself: the log only
    )
    console, log = tmp_path / "x.console", tmp_path / "x.log"
    console.write_bytes(b"")
    env = dict(os.environ, OGRPO_CONSOLE=str(console), OGRPO_STEP_LOG=str(log),
               PYTHONPATH=os.pathsep.join([str(lib), str(REPO)]))
    with open(log, "wb") as f:
        proc = subprocess.run([sys.executable, "-c", code], stdout=f, stderr=subprocess.STDOUT, env=env,
                              timeout=60)
    logged, shown = log.read_text(), console.read_text()
    assert proc.returncode == 0, logged
    for text in ("noisylib deprecation", "noisylib record", "noisylib print", "noisylib native", "ogrpo line",
                 "ogrpo record", "3/3"):
        assert text in logged, text
    assert "ogrpo line" in shown and "ogrpo record" in shown and "3/3" in shown
    assert "noisylib" not in shown.split("note: ")[0], shown
    assert shown.count("0/3") == 1, shown  # one bar shown, the other only logged
    # the one-line summary counts the library's warning and its WARNING record, and names the log
    assert f"note: 2 warnings from libraries, not shown here: {log}" in shown.splitlines(), shown


def test_an_exception_nothing_caught_reaches_the_log_and_the_console_whole(tmp_path):
    """The interpreter prints an uncaught exception from C, with no Python caller: its report, the step's last
    words, is kept whole (it was lost: "lost sys.stderr") and shown."""
    code = ("from ogrpo.trainer import quiet\n"
            "assert quiet.install()\n"
            "def request():\n"
            "    raise ConnectionError('Connection reset by peer')\n"
            "request()\n")
    console, log = tmp_path / "x.console", tmp_path / "x.log"
    console.write_bytes(b"")
    env = dict(os.environ, OGRPO_CONSOLE=str(console), OGRPO_STEP_LOG=str(log), PYTHONPATH=str(REPO))
    with open(log, "wb") as f:
        proc = subprocess.run([sys.executable, "-c", code], stdout=f, stderr=subprocess.STDOUT, env=env, timeout=60)
    logged, shown = log.read_text(), console.read_text()
    assert proc.returncode == 1
    for text in (logged, shown):
        assert "in request" in text and "ConnectionError: Connection reset by peer" in text, text
        assert "lost sys.stderr" not in text


def test_a_cli_command_keeps_library_output_in_its_log(tmp_path):
    """`libraries_to_log`, as `ogrpo doctor` uses it around its checks: a library's warning and print go to the
    log only, O-GRPO's line reaches the terminal, and one note names the log."""
    lib = tmp_path / "lib"
    (lib / "chattylib").mkdir(parents=True)
    (lib / "chattylib" / "__init__.py").write_text(
        "import warnings\nwarnings.warn('chattylib at import', UserWarning)\nprint('chattylib print')\n")
    log = tmp_path / "logs" / "doctor.log"
    code = (
        "__name__ = 'ogrpo.cli_check'\n"
        "import sys\n"
        "from ogrpo.trainer.quiet import libraries_note, libraries_to_log\n"
        f"with libraries_to_log({str(log)!r}) as counts:\n"
        "    import chattylib\n"
        "    print('ogrpo inside')\n"
        "print(libraries_note(counts), file=sys.stderr)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(lib), str(REPO)]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "ogrpo inside\n"
    assert proc.stderr.splitlines() == [f"note: library output (3 lines, 1 warning) is in {log}"], proc.stderr
    logged = log.read_text()
    assert "chattylib at import" in logged and "chattylib print" in logged and "ogrpo inside" in logged


def test_an_unwritable_cli_log_leaves_the_output_where_it_was(tmp_path, capsys):
    from ogrpo.trainer.quiet import libraries_note, libraries_to_log

    blocker = tmp_path / "file"
    blocker.write_text("")
    with libraries_to_log(blocker / "logs" / "doctor.log") as counts:  # its folder cannot be made
        print("shown")
    assert capsys.readouterr().out == "shown\n" and libraries_note(counts) is None
