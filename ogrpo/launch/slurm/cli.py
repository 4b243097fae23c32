"""Slurm's client commands, run so that a cluster that cannot answer is one line within seconds (exit 2), not a
minute of retries: `run_slurm`, and the checks it runs when a command is slow (a SLURM_CONF naming no file, no
controller accepting a connection)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from ogrpo.errors import OgrpoError

# A Slurm command that has not answered after this long gets its configuration and controller checked: a
# controller that is down makes squeue retry for ~18 s and sbatch ~9 s before they say so (Slurm 22.05), and a
# SLURM_CONF naming no file makes them retry reading it for 60 s.
PROBE_AFTER_S = 2.0
PROBE_TIMEOUT_S = 2.0
DEFAULT_CONF = "/etc/slurm/slurm.conf"


def conf_problem() -> str | None:
    """A SLURM_CONF that names no file (Slurm's commands would retry reading it for a minute)."""
    conf = os.environ.get("SLURM_CONF")
    if conf and not os.path.isfile(conf):
        return (f"SLURM_CONF={conf} does not exist: point it at the cluster's slurm.conf (or unset it), or run "
                "this on a login node of the cluster")
    return None


def configured() -> bool:
    """Whether this machine has a Slurm configuration file (SLURM_CONF's, else the default slurm.conf); a
    configless site's client learns it from the controller, and cannot tell without one."""
    return os.path.isfile(os.environ.get("SLURM_CONF") or DEFAULT_CONF)


def controllers(conf_text: str) -> tuple[list[str], int]:
    """The controller addresses and port of a slurm.conf (`SlurmctldHost=name(addr)`, or the older
    ControlMachine/ControlAddr/BackupController/BackupAddr; `SlurmctldPort=6817[-6818]`)."""
    hosts, port, legacy = [], 6817, {}
    for line in conf_text.splitlines():
        key, sep, value = line.split("#", 1)[0].strip().partition("=")
        key, value = key.strip().lower(), value.strip()
        if not sep or not value:
            continue
        if key == "slurmctldhost":
            name, _, addr = value.partition("(")
            hosts.append(addr.rstrip(")") or name)
        elif key == "slurmctldport":
            first = value.split("-")[0]
            port = int(first) if first.isdigit() else port
        elif key in ("controlmachine", "controladdr", "backupcontroller", "backupaddr"):
            legacy[key] = value
    if not hosts:
        for name, addr in (("controlmachine", "controladdr"), ("backupcontroller", "backupaddr")):
            if legacy.get(addr) or legacy.get(name):
                hosts.append(legacy.get(addr) or legacy[name])
    return hosts, port


def controller_unreachable() -> str | None:
    """Why no controller of this cluster accepts a connection, or None (one does, or slurm.conf cannot tell:
    a configless site)."""
    import socket

    path = os.environ.get("SLURM_CONF") or DEFAULT_CONF
    try:
        hosts, port = controllers(Path(path).read_text())
    except OSError:
        return None
    errors = []
    for host in hosts:
        try:
            socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
            return None
        except OSError as exc:
            errors.append(f"{host}:{port}: {exc.strerror or type(exc).__name__}")
    if not errors:
        return None
    return (f"cannot reach the Slurm controller ({'; '.join(errors)}; SLURM_CONF={path}): check `scontrol ping` "
            "and that this is a login node of the cluster")


def not_installed(tool: str) -> str:
    """The one line for a Slurm command missing from PATH (a laptop, or a login node without the slurm module)."""
    return (f"Slurm is not installed here: no {tool} on PATH (run this on a login node of the cluster, or load "
            "its slurm module)")


def run_slurm(cmd: list[str], timeout: float = 30, **popen) -> subprocess.CompletedProcess:
    """Run a Slurm client command; OgrpoError (one line, exit 2) when Slurm is not installed, and within seconds
    when the cluster cannot answer: SLURM_CONF names no file, no controller accepts a connection, or the command
    hangs past `timeout`."""
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    except FileNotFoundError:
        raise OgrpoError(not_installed(cmd[0])) from None
    try:
        try:
            out, err = proc.communicate(timeout=min(PROBE_AFTER_S, timeout))
        except subprocess.TimeoutExpired:
            # only a command that is slow to answer is looked into: a healthy cluster answers in milliseconds
            problem = conf_problem() or controller_unreachable()
            if problem:
                raise OgrpoError(problem) from None
            out, err = proc.communicate(timeout=max(0.0, timeout - PROBE_AFTER_S))
    except subprocess.TimeoutExpired:
        raise OgrpoError(f"`{' '.join(cmd[:3])}` did not answer within {timeout:.0f} s: the Slurm controller is "
                         "overloaded or unreachable (scontrol ping)") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def unanswered(out: subprocess.CompletedProcess) -> None:
    """Raise OgrpoError when a Slurm command failed because the cluster cannot answer (its configuration or its
    controller), not because of what it was asked: a controller that refuses connections makes squeue fail fast,
    and "job 123 is not known" would then blame the job."""
    if out.returncode != 0:
        problem = conf_problem() or controller_unreachable() or configless_problem(out.stderr or "")
        if problem:
            raise OgrpoError(problem)


def configless_problem(stderr: str) -> str | None:
    """No slurm.conf here and no configless controller found (the client's DNS SRV lookup failed): Slurm's
    commands then fail at once, and a job they were asked about would wrongly seem unknown."""
    if configured() or "fetch_config" not in stderr:
        return None
    said = next((line.split("error:", 1)[1].strip() for line in stderr.splitlines() if "fetch_config" in line), "")
    return (f"no Slurm configuration here (no SLURM_CONF, no {DEFAULT_CONF}, and no configless controller found: "
            f"{said}): run this on a login node of the cluster, or point SLURM_CONF at its slurm.conf")


def require(tool: str) -> None:
    if shutil.which(tool) is None:
        raise OgrpoError(not_installed(tool))
