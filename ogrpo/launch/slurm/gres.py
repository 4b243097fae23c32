"""Which partitions have GPUs of the plan's GRES type (`sinfo` GRES), checked before a job is submitted.

A GPU plan asks for its type (`--gres=gpu:a40:3`, ogrpo.launch.slurm.sbatch): on a partition without that type Slurm
would keep the job pending forever or refuse it with a generic message, and an untyped request could land a bf16
plan on V100s. `check_gres_type` refuses (exit 2) naming the partitions that have the type.
"""

from __future__ import annotations

import re
import subprocess

from ogrpo.errors import OgrpoError

# one GRES item of `sinfo -o %G`: gpu[:type]:count[(S:0-1)] (count may be followed by its socket binding)
_ITEM = re.compile(r"^gpu(?::(?P<type>[^:(]+))?:(?P<count>\d+)")


def parse_gres(text: str) -> dict[str | None, int]:
    """GPU type -> count of one node's GRES string ('gpu:a40:3,gpu:v100:2(S:0)', '(null)'); None: untyped."""
    out: dict[str | None, int] = {}
    for item in re.split(r",(?=[a-z])", text.strip()):
        m = _ITEM.match(item.strip())
        if m:
            out[m.group("type")] = out.get(m.group("type"), 0) + int(m.group("count"))
    return out


def partition_gpus(sinfo_lines: str) -> tuple[dict[str, dict[str | None, int]], str | None]:
    """({partition: {type: most GPUs of that type on one node}}, default partition) from `sinfo -h -N -o '%P %G'`
    lines (one per node and partition; the default partition carries a '*')."""
    parts: dict[str, dict[str | None, int]] = {}
    default = None
    for line in sinfo_lines.splitlines():
        fields = line.split(None, 1)
        if not fields:
            continue
        name = fields[0]
        if name.endswith("*"):
            name = name[:-1]
            default = name
        have = parts.setdefault(name, {})
        for gtype, count in parse_gres(fields[1] if len(fields) > 1 else "").items():
            have[gtype] = max(have.get(gtype, 0), count)
    return parts, default


def gres_problem(parts: dict[str, dict[str | None, int]], default: str | None, partition: str | None,
                 gres_type: str, count: int) -> str | None:
    """Why a request for COUNT GPUs of GRES_TYPE per node on PARTITION (None: the default) cannot start; None
    when some node of it has them. Pure, for tests."""
    part = partition or default
    if part is None or part not in parts:
        return None  # unknown partition: preflight's own check names it
    have = parts[part]
    where = ", ".join(sorted(p for p, types in parts.items() if types.get(gres_type, 0) >= count))
    if have.get(gres_type, 0) >= count:
        return None
    if 0 < have.get(gres_type, 0) and max(have.values()) < count:
        return None  # too many GPUs per node of any type: preflight's count check names that
    same = [t for t in have if t and t.lower() == gres_type.lower() and t != gres_type]
    if same:
        return (f"partition {part} names these GPUs {same[0]!r}, not {gres_type!r}: submit with --gres-type {same[0]} "
                "(or ogrpo.gres_type)")
    types = ", ".join(f"{t or 'untyped'} x{n}" for t, n in sorted(have.items(), key=lambda kv: str(kv[0]))) or "none"
    if have.get(gres_type, 0):
        what = f"nodes of partition {part} have at most {have[gres_type]} {gres_type} GPUs, not {count}"
    else:
        what = f"partition {part} has no {gres_type} GPUs (its GPUs: {types})"
    fix = (f"partitions with {count} per node: {where}; submit with --partition {where.split(', ')[0]}" if where
           else f"no partition has {count} {gres_type} GPUs per node")
    return (f"the plan asks Slurm for gpu:{gres_type}:{count} but {what}; {fix} (or --gres-type for the site's "
            "name of these GPUs, 'any' for any GPU; sinfo -o '%P %G')")


def check_gres_type(opts) -> None:
    """Refuse (OgrpoError, exit 2) a typed GPU request the partition has no nodes for, naming those that do.
    Nothing is checked when sinfo cannot tell (sbatch --test-only decides) or the user asked for GPUs their own
    way (`--slurm gpus=...`/`gres=...`)."""
    if not opts.gpus_per_node or not opts.gres_type:
        return
    if any(k in opts.extra for k in ("gpus", "gpus-per-node", "gres")):
        return
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%P %G"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return
    if out.returncode != 0:
        return
    parts, default = partition_gpus(out.stdout)
    problem = gres_problem(parts, default, opts.partition, opts.gres_type, int(opts.gpus_per_node))
    if problem:
        raise OgrpoError(problem)
