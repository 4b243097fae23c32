"""`--grid KEY=V1,V2 ... [--seeds N]` → the sweep's points (pure: no files, no planning).

A point is one full run: the recipe with the grid's values for it set over the recipe's own. Keys are the run
config's (flat TRL keys, `ogrpo.KEY` for O-GRPO's options), checked here against the same field table
`load_run_config` uses, so a typo is one line naming the flag before anything is planned. Keys that decide the
job's Slurm request or where it runs are refused: every task of the sweep's job array asks for the same
resources, and each point's run directory is the sweep's to choose.
"""

from __future__ import annotations

import difflib
import itertools
import math
from dataclasses import dataclass, field

from ogrpo import config
from ogrpo.errors import OgrpoError
from ogrpo.values import choice_problem, coerce, range_problem

# One cluster, one request per array task, one run directory per point: these cannot vary between points.
FIXED_KEYS = ("output_dir", "ogrpo.gpus", "ogrpo.plan", "ogrpo.partition", "ogrpo.account", "ogrpo.qos",
              "ogrpo.time", "ogrpo.gres_type", "ogrpo.cpus_per_gpu", "ogrpo.mem_per_gpu", "ogrpo.job_name",
              "ogrpo.container")
MAX_POINTS = 1000  # Slurm's default MaxArraySize is 1001 (indices 0-1000)


@dataclass(frozen=True)
class Point:
    index: int
    values: dict = field(default_factory=dict)  # grid key → value, in --grid order
    seed: int | None = None  # set when --seeds asked for several seeds of each grid point

    def overrides(self) -> dict:
        """What is set over the recipe for this point (load_and_plan's `trl`)."""
        out = dict(self.values)
        if self.seed is not None:
            out["seed"] = self.seed
        return out

    def label(self) -> str:
        parts = [f"{k}={format_value(v)}" for k, v in self.values.items()]
        if self.seed is not None:
            parts.append(f"seed={self.seed}")
        return ", ".join(parts) or "the recipe as written"

    def to_dict(self) -> dict:
        return {"index": self.index, "values": dict(self.values), "seed": self.seed}

    @classmethod
    def from_dict(cls, data: dict) -> "Point":
        return cls(index=int(data["index"]), values=dict(data.get("values") or {}), seed=data.get("seed"))


def format_value(value) -> str:
    """A grid value as the user would type it again (1e-06, 0.04, true)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)


def parse_value(text: str):
    """A value as YAML-ish typing would read it, but with `1e-6` a float (PyYAML reads it as a string)."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("null", "none", "~"):
        return None
    for kind in (int, float):
        try:
            value = kind(text)
        except ValueError:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            break
        return value
    return text


def _known_key(key: str, flag: str) -> tuple:
    """(kinds, name as the validators know it) of a run-config key; OgrpoError naming the closest one."""
    from dataclasses import fields as dc_fields

    if key.startswith("ogrpo."):
        name = key[len("ogrpo."):]
        known = {f.name for f in dc_fields(config.OgrpoOptions)}
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
            raise OgrpoError(f"{flag}: unknown key {key!r}" + (f": did you mean ogrpo.{close[0]}?" if close else
                                                                 f"; O-GRPO's options: {', '.join(sorted(known))}"))
        return tuple(config._OGRPO_KINDS[name]), key
    index = config._field_index()
    if key not in index:
        close = difflib.get_close_matches(key, list(index), n=1, cutoff=0.75)
        raise OgrpoError(f"{flag}: unknown key {key!r}" + (f": did you mean {close[0]}?" if close else
                                                           ": a TRL GRPOConfig key or ogrpo.KEY"))
    return tuple(index[key]["kinds"]), key


def _check_value(key: str, value, kinds: tuple, flag: str):
    try:
        value = coerce(key, value, kinds)
    except ValueError as exc:
        raise OgrpoError(f"{flag}: {exc}") from None
    problem = range_problem(key, value) or choice_problem(key, value)
    if problem:
        raise OgrpoError(f"{flag}: {problem}")
    return value


def parse_grid(items: list[str] | None) -> dict[str, list]:
    """`KEY=V1,V2` items → {key: [values]} in the order given; OgrpoError (exit 2) naming the bad item."""
    grid: dict[str, list] = {}
    for item in items or []:
        flag = f"--grid {item}"
        key, sep, rest = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise OgrpoError(f"{flag}: expected KEY=V1,V2,... (e.g. --grid learning_rate=1e-6,3e-6)")
        if key in grid:
            raise OgrpoError(f"{flag}: {key} is already swept by an earlier --grid; give all its values in one")
        if key in FIXED_KEYS:
            raise OgrpoError(f"{flag}: {key} cannot vary between points (every task of the sweep's job array has "
                             "the same cluster, Slurm request and its own run directory); set it for the whole "
                             "sweep with the sweep's options or the recipe")
        kinds, name = _known_key(key, flag)
        texts = [t.strip() for t in rest.split(",")]
        if not rest.strip() or any(t == "" for t in texts):
            raise OgrpoError(f"{flag}: empty value; list the values separated by commas, e.g. {key}=1,2")
        values = [_check_value(name, parse_value(t), kinds, flag) for t in texts]
        seen = []
        for v in values:
            if v in seen:
                raise OgrpoError(f"{flag}: value {format_value(v)} is listed twice")
            seen.append(v)
        grid[key] = values
    return grid


def parse_seeds(seeds: int | None, grid: dict) -> int | None:
    if seeds is None:
        return None
    if seeds < 1:
        raise OgrpoError(f"--seeds {seeds}: must be 1 or more (the number of seeds run for each grid point)")
    if "seed" in grid:
        raise OgrpoError("--seeds with --grid seed=...: give the seeds one way (--grid seed=1,2,3 or --seeds 3)")
    return seeds


def expand(grid: dict[str, list], seeds: int | None = None, base_seed: int = 42) -> list[Point]:
    """Every combination of the grid's values (the first --grid varies slowest), each with `seeds` seeds
    base_seed, base_seed + 1, ... (the recipe's seed first, so seed 0 of the sweep is the recipe's run)."""
    keys = list(grid)
    combos = list(itertools.product(*(grid[k] for k in keys))) if keys else [()]
    seed_list = [base_seed + i for i in range(seeds)] if seeds else [None]
    n = len(combos) * len(seed_list)
    if n > MAX_POINTS:
        raise OgrpoError(f"the grid has {n} points; a sweep runs at most {MAX_POINTS} (one Slurm job array): "
                         "split it into several sweeps")
    points = []
    for combo in combos:
        for seed in seed_list:
            points.append(Point(index=len(points), values=dict(zip(keys, combo)), seed=seed))
    return points
