"""The one reader of what Slurm prints: scontrol's `Key=Value` records and Slurm time strings. Standard library only.

- `key_values(text)`: `scontrol show job|partition|node -o` (one record a line, `Key=Value` words);
  `key_values(text, lines=True)`: `scontrol show config` (`Key = Value` a line, values with spaces).
- `seconds(text)`: a Slurm duration in seconds (KillWait, GraceTime as scontrol prints them; `--time` with
  `bare="minutes"`), None for UNLIMITED/NONE/INFINITE/empty or anything else that is not a duration.
- `parsable_job_id(stdout)`: the job id `sbatch --parsable` printed (`ID` or `ID;CLUSTER`), None when none.
"""

from __future__ import annotations

import re

_UNIT_SECONDS = re.compile(r"(\d+)\s*(?:sec|secs|s)?")  # scontrol show config: `KillWait = 30 sec`
# Slurm's time grammar: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS
_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")


def key_values(text: str, *, lines: bool = False) -> dict[str, str]:
    """scontrol's `Key=Value` output → {Key: Value}.

    Words (default): a record of `scontrol show job|partition|node -o`; a value with spaces (a job's Comment=) is
    cut at the first one, no reader here needs them. `lines=True`: `scontrol show config`, one `Key = Value` a line
    with the value's spaces kept, lines whose key is empty or has a space (headers, `Slurmctld(primary) at ... is
    UP`) skipped. Either way the split is at the first '=' (values may hold more: AuthInfo's `cred_expire=10`),
    an empty value is kept as '', an item without '=' is skipped, and a repeated key keeps its first value."""
    out: dict[str, str] = {}
    for item in text.splitlines() if lines else text.split():
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key or " " in key or key in out:
            continue
        out[key] = value.strip()
    return out


def seconds(text: str | int | None, *, bare: str = "seconds") -> int | None:
    """A Slurm duration → seconds; None when it is none (UNLIMITED, NONE, INFINITE, empty, not a duration).

    Forms: MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, and a bare number, which is seconds in what scontrol prints
    (`bare="seconds"`: KillWait, GraceTime; there also `5 sec`, `5 secs`, `5s`) and minutes in what sbatch is
    given (`bare="minutes"`: `--time 90`, where a unit is not Slurm's and refused)."""
    if text is None:
        return None
    v = str(text).strip().lower()
    if bare == "seconds":
        m = _UNIT_SECONDS.fullmatch(v)
        if m:
            return int(m.group(1))
    elif bare != "minutes":
        raise ValueError(f"bare: 'seconds' or 'minutes', not {bare!r}")
    m = _TIME.fullmatch(v)
    if not m:
        return None
    days, a, b, c = m.groups()
    a, b, c = int(a), int(b or 0), int(c or 0)
    if days is not None:  # D-HH[:MM[:SS]]
        return int(days) * 86400 + a * 3600 + b * 60 + c
    if v.count(":") == 2:  # HH:MM:SS
        return a * 3600 + b * 60 + c
    if v.count(":") == 1:  # MM:SS
        return a * 60 + b
    return a * (60 if bare == "minutes" else 1)  # a bare number (only `minutes` gets here)


def parsable_job_id(stdout: str) -> str | None:
    """The job id in what `sbatch --parsable` printed (`12345`, or `12345;cluster` on a multi-cluster site); None
    when it printed none."""
    job_id = stdout.strip().split(";")[0]
    return job_id if job_id.isdigit() else None
