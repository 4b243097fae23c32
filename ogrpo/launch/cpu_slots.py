"""Disjoint cores for the server and the trainer of a CPU plan on one machine (`--gpus 2xcpu`, local backend).

A CPU "device" is a process. The plan gives each step its slots as data (`OGRPO_CPU_SLOTS=start:count:total`
in the step's environment: the server 0:1:N, the trainer 1:N-1:N); the local launcher turns them into cores of
the cores this machine lets it use, and each process pins itself at start. Without this, vLLM's CPU engine
spreads its OpenMP threads over every core and the trainer computing beside it (`ogrpo.overlap`) slows both down:
the overlap then gains nothing. The server's HTTP front end (vLLM's API process: requests, streamed answers) is
not compute: once its engine has started on the server's cores it moves to all of them (`release_frontend`), so
that it takes the trainer's idle time rather than the engine's core (lossless streams each completion's tokens,
which keeps it busy; measured: the server's busy time per step 0.926 and 0.851 s against 0.983 and 0.959 pinned).
Under Slurm each step's srun gets its own CPUs from Slurm, so nothing is done there.
"""

from __future__ import annotations

import os

SLOTS_ENV = "OGRPO_CPU_SLOTS"  # from the plan: start:count:total
CORES_ENV = "OGRPO_CPU_CORES"  # from the launcher: the cores this step's processes pin themselves to
# from the launcher, for the server: the cores its HTTP front end moves to once the engine has started on CORES_ENV
FRONTEND_ENV = "OGRPO_CPU_FRONTEND_CORES"


def cores_for(slots: str, allowed: list[int]) -> list[int] | None:
    """This step's share of `allowed` (sorted core ids), split into `total` near-equal slots; None when the
    machine has fewer cores than slots (then nothing is pinned) or `slots` is malformed."""
    try:
        start, count, total = (int(x) for x in slots.split(":"))
    except ValueError:
        return None
    if total < 1 or len(allowed) < total or not 0 <= start < start + count <= total:
        return None
    cores = sorted(allowed)
    bounds = [len(cores) * i // total for i in range(total + 1)]
    return cores[bounds[start]:bounds[start + count]]


def cpu_list(cores: list[int]) -> str:
    """`0-3,6`: the form vLLM's VLLM_CPU_OMP_THREADS_BIND (libnuma's cpu string) and taskset read."""
    parts, run = [], [cores[0]]
    for c in cores[1:]:
        if c == run[-1] + 1:
            run.append(c)
        else:
            parts.append(run)
            run = [c]
    parts.append(run)
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in parts)


def step_env(role: str, slots: str | None) -> dict[str, str]:
    """What the local launcher adds to a step's environment for its slots (empty when nothing is pinned)."""
    cores = cores_for(slots, list(os.sched_getaffinity(0))) if slots else None
    if not cores:
        return {}
    env = {CORES_ENV: cpu_list(cores)}
    if role == "server":
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list(cores)
        env[FRONTEND_ENV] = cpu_list(sorted(os.sched_getaffinity(0)))
    return env


def _cores(spec: str) -> list[int]:
    cores = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cores += list(range(int(lo), int(hi or lo) + 1))
    return cores


def release_frontend(environ=os.environ, poll_s: float = 0.5, give_up_s: float = 1800.0):
    """In the server's API process: once its engine process has started (pinned to the server's cores, which it
    inherited), move this process's threads to FRONTEND_ENV's cores. The front end (HTTP, streamed answers)
    then takes the trainer's idle time instead of the engine's core. Runs on a daemon thread, returned (None
    where nothing is to move)."""
    import threading
    import time

    spec = environ.get(FRONTEND_ENV)
    if not spec:
        return None
    wide, me = _cores(spec), os.getpid()

    def children() -> bool:  # vLLM names its engine process VLLM::EngineCore
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        stat = f.read()
                    if "EngineCor" in stat.split(")", 1)[0] and int(stat.rsplit(")", 1)[1].split()[1]) == me:
                        return True
                except (OSError, ValueError, IndexError):
                    continue
        return False

    def run() -> None:
        import sys

        deadline = time.monotonic() + give_up_s
        while not children():
            if time.monotonic() > deadline:  # no engine process of vLLM's name: the front end stays where it is
                sys.stderr.write("ogrpo serve: no VLLM::EngineCore process seen; the HTTP front end stays on the "
                                 "server's cores\n")
                return
            time.sleep(poll_s)
        time.sleep(poll_s)
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), wide)
            except OSError:
                pass
        sys.stderr.write(f"ogrpo serve: the engine started; the HTTP front end may use cores {spec}\n")

    thread = threading.Thread(target=run, name="ogrpo-release-frontend", daemon=True)
    thread.start()
    return thread


def pin_from_env(environ=os.environ) -> list[int] | None:
    """At a step process's start: pin it (and what it starts) to the cores the launcher chose."""
    spec = environ.get(CORES_ENV)
    if not spec:
        return None
    cores = _cores(spec)
    os.sched_setaffinity(0, cores)
    return cores
