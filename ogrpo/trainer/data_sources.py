"""Which datasets a recipe names, and their columns and splits read cheaply, for the plan-time check.

A recipe names its data as TRL and open-r1 do: `dataset_name` (+ `dataset_config`, `dataset_train_split`), open-r1's
`dataset_mixture: {datasets: [{id, config, split, columns, weight}], seed, test_split_size}`, or TRL's top-level
`datasets: [{path, name, split, columns, fraction, ...}]`. Each name is a hub id, a local .jsonl/.json/.parquet/
.csv/.tsv file, a directory of such files, or a `save_to_disk` directory (cluster nodes are often offline).

Only schemas and first rows are read (json/csv/pyarrow; `import datasets` costs ~1 s, too much for `ogrpo plan`).
Hub datasets are looked up in the local HF hub cache; when absent they cannot be checked, which is a warning.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ogrpo import tiny
from ogrpo.errors import ConfigError, OgrpoError
from ogrpo.local_paths import local_path
from ogrpo.tasks import task_rows

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".tsv": "csv"}
SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
# open-r1 keys whose meaning this package gives (config.py then does not call them ignored).
RECIPE_KEYS = frozenset({"dataset_prompt_column", "system_prompt", "dataset_mixture"})


@dataclass
class Source:
    """One dataset to load: what `datasets.load_dataset`/`load_from_disk` is given."""

    name: str
    config: str | None = None
    split: str = "train"
    columns: list[str] | None = None  # select these (mixtures)
    weight: float | None = None  # open-r1: share of this dataset's rows kept; TRL: `fraction` of the mixture
    data_files: object = None  # TRL DatasetConfig passthrough
    data_dir: str | None = None


def is_local(name: str) -> bool:
    return name.startswith(("/", ".", "~")) or Path(name).expanduser().exists()


def sources(trl: dict) -> tuple[str, list[Source]]:
    """("name" | "open-r1 mixture" | "TRL mixture", the datasets) as the recipe names them; mixtures win over
    dataset_name, as in open-r1 and TRL's scripts."""
    mix = trl.get("dataset_mixture")
    if mix:
        if not isinstance(mix, dict) or not isinstance(mix.get("datasets"), list) or not mix["datasets"]:
            raise ConfigError(["dataset_mixture: expected {datasets: [{id, config, split, columns, weight}], seed, "
                               "test_split_size} with at least one dataset"], "dataset_mixture")
        out = []
        for i, d in enumerate(mix["datasets"]):
            if not isinstance(d, dict) or not d.get("id"):
                raise ConfigError([f"dataset_mixture.datasets[{i}]: needs an `id` (hub name or local path)"],
                                  "dataset_mixture")
            out.append(Source(str(d["id"]), d.get("config"), d.get("split") or "train", d.get("columns"),
                              d.get("weight")))
        return "open-r1 mixture", out
    mix = trl.get("datasets")
    if mix:
        out = []
        for i, d in enumerate(mix):
            if not isinstance(d, dict) or not d.get("path"):
                raise ConfigError([f"datasets[{i}]: needs a `path` (TRL DatasetConfig)"], "datasets")
            out.append(Source(str(d["path"]), d.get("name"), d.get("split") or "train", d.get("columns"),
                              d.get("fraction"), d.get("data_files"), d.get("data_dir")))
        return "TRL mixture", out
    name = trl.get("dataset_name")
    if not name:
        return "none", []
    return "name", [Source(str(name), trl.get("dataset_config"), trl.get("dataset_train_split") or "train")]


def _is_builtin(name: str) -> bool:
    return name.startswith("ogrpo:") or name == "tiny"


def absolute_sources(trl: dict, base_dirs: list[Path]) -> list[tuple[str, str, str]]:
    """Rewrite the recipe's relative local dataset paths (dataset_name, open-r1's mixture ids, TRL's `datasets`
    paths) in `trl` as absolute paths, found as reward files are (the submit directory, then the config's): the
    job reads them from its job directory. Returns (key, old, new) for each; hub ids (found nowhere here) stay."""
    slots: list[tuple[str, dict, str]] = []  # (key as listed, the dict holding it, its field)
    mix = trl.get("dataset_mixture")
    if isinstance(mix, dict) and isinstance(mix.get("datasets"), list):
        slots += [(f"dataset_mixture.datasets[{i}].id", d, "id") for i, d in enumerate(mix["datasets"])
                  if isinstance(d, dict)]
    if isinstance(trl.get("datasets"), list):
        slots += [(f"datasets[{i}].path", d, "path") for i, d in enumerate(trl["datasets"]) if isinstance(d, dict)]
    slots.append(("dataset_name", trl, "dataset_name"))
    out = []
    for key, holder, name in slots:
        value = holder.get(name)
        if not isinstance(value, str) or not value or _is_builtin(value) or Path(value).is_absolute():
            continue
        if value in FILE_BUILDERS.values() and holder.get("data_files"):
            continue  # TRL's DatasetConfig(path="json", data_files=...): a builder name
        found = local_path(value, base_dirs)
        if found is not None:
            holder[name] = os.path.abspath(found)
            out.append((key, value, holder[name]))
    return out


# --- reading columns -------------------------------------------------------------------------------------------


class Unreadable(Exception):
    """The schema could not be read here (not an error in the recipe)."""


def file_columns(path: Path) -> list[str]:
    """Column names from a data file's schema or first row; raises ValueError for an empty or unknown file."""
    suffix = path.suffix.lower()
    if suffix not in FILE_BUILDERS:
        raise ValueError(f"has an unknown file type {suffix!r}; use .jsonl, .json, .parquet or .csv")
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        meta = pq.read_metadata(path)
        if meta.num_rows == 0:
            raise ValueError("has no rows")
        return list(meta.schema.to_arrow_schema().names)
    with path.open("r", errors="replace") as f:
        first = ""
        for line in f:
            if line.strip():
                first = line
                break
        if not first:
            raise ValueError("is empty (no rows)")
        if suffix in (".csv", ".tsv"):
            import csv

            return next(csv.reader([first], delimiter="\t" if suffix == ".tsv" else ","))
        try:
            row = json.loads(first)  # JSON lines (datasets reads .json files this way too)
        except ValueError:
            row = None
        if isinstance(row, dict):
            return list(row)
    data = json.loads(path.read_text())  # one JSON document: a list of rows or a dict of columns
    if isinstance(data, list) and data and isinstance(data[0], dict):
        return list(data[0])
    if isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
        return list(data)
    raise ValueError("is not a list of JSON objects nor JSON lines")


def jsonl_problem(path: Path, column: str, rows: int = 64) -> str | None:
    """The first problem in a JSON-lines file's first `rows` rows that fails the job at load or at its first step:
    a line that is no JSON object, a prompt that is neither text nor chat messages ({role, content})."""
    with path.open("r", errors="replace") as f:
        seen = 0
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                return f"line {number} is not JSON ({exc.msg})"
            if not isinstance(row, dict):
                return f"line {number} is not a JSON object"
            value = row.get(column)
            if not (isinstance(value, str) or (isinstance(value, list) and value and all(
                    isinstance(m, dict) and "role" in m and "content" in m for m in value))):
                what = "null" if value is None else type(value).__name__
                return (f"line {number}: {column!r} is {what}, not text or a list of chat messages "
                        "({role, content})")
            seen += 1
            if seen >= rows:
                return None
    return None


def _saved_columns(path: Path, split: str) -> list[str]:
    """A `save_to_disk` directory (Dataset or DatasetDict)."""
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits") or []
        if split not in splits:
            raise ValueError(f"has no split {split!r} (splits: {', '.join(splits) or 'none'}); set "
                             "dataset_train_split")
        path = path / split
    info = path / "dataset_info.json"
    if not info.is_file():
        raise Unreadable("no dataset_info.json")
    return list((json.loads(info.read_text()).get("features") or {}))


def _data_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in FILE_BUILDERS
                  and not any(part.startswith(".") for part in p.relative_to(root).parts))


def _split_files(files: list[Path], root: Path, split: str, config: str | None) -> list[Path]:
    """The files `datasets` would read for a split: names carrying the split (train-0000.parquet, test.jsonl,
    data/train/...), else every file as `train`; a config narrows to files under a directory of its name."""
    if config:
        narrowed = [f for f in files if config in f.relative_to(root).parts[:-1]]
        files = narrowed or files

    def tokens(f: Path) -> set[str]:
        return set(re.split(r"[/\\._-]", str(f.relative_to(root))))

    named = [f for f in files if split in tokens(f)]
    if named:
        return named
    if any({"train", "test", "validation"} & tokens(f) for f in files):
        return []  # files are split by name, and none is this split
    return files if split == "train" else []


def _dir_columns(root: Path, split: str, config: str | None) -> list[str]:
    files = _data_files(root)
    if not files:
        raise Unreadable("no data files")
    chosen = _split_files(files, root, split, config)
    if not chosen:
        names = ", ".join(str(f.relative_to(root)) for f in files[:6])
        raise ValueError(f"has no files for split {split!r} (files: {names}); set dataset_train_split")
    return file_columns(chosen[0])


def hub_cache_dir(name: str) -> Path | None:
    home = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub")
    snaps = Path(home) / ("datasets--" + name.replace("/", "--")) / "snapshots"
    if not snaps.is_dir():
        return None
    found = sorted((p for p in snaps.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def columns_of(src: Source) -> list[str]:
    """The source's columns. ValueError: a problem in the recipe; Unreadable: cannot be checked here."""
    path = Path(src.name).expanduser()
    if src.name in ("json", "csv", "parquet") and src.data_files:  # TRL's DatasetConfig(path="json", data_files=)
        files = src.data_files.get(src.split) if isinstance(src.data_files, dict) else src.data_files
        first = Path(str(files[0] if isinstance(files, list) else files)).expanduser()
        if not first.is_file():
            raise Unreadable(f"data_files {first} is not a local file")
        return file_columns(first)
    if path.is_file():
        return file_columns(path)
    if path.is_dir():
        if any((path / m).is_file() for m in SAVED_MARKERS):
            return _saved_columns(path, src.split)
        return _dir_columns(path, src.split, src.config)
    if is_local(src.name):
        raise ValueError("does not exist; fix the path (a hub name or a local file/directory)")
    try:
        cached = hub_cache_dir(src.name)
        if cached is None:
            raise Unreadable("not in the local HF hub cache")
        return _dir_columns(cached, src.split, src.config)
    except PermissionError as exc:  # another user's HF_HOME, or a shared cache closed to this user
        raise Unreadable(f"the HF hub cache cannot be read by this user: {exc.filename}") from None


def builtin_columns(name: str) -> list[str]:
    """Columns of a built-in dataset (ogrpo:tiny, ogrpo:tiny-math, ...), from its first generated row."""
    if tiny.is_tiny(name):
        return list(tiny.toy_prompts(1)[0])

    try:
        return list(task_rows(name, 1)[0])
    except OgrpoError as exc:
        raise ValueError(str(exc).replace(f"unknown built-in dataset {name!r}", "is not a built-in dataset")) from None


def check_data(trl: dict, prompt_column: str, needed: dict[str, list[str]]) -> list[str]:
    """Check every local (or cached) dataset the recipe names has the split and the columns the prompt and the
    rewards read. Returns warnings (datasets that could not be checked); raises ConfigError naming each problem."""
    kind, srcs = sources(trl)
    problems: list[str] = []
    warnings: list[str] = []
    if not srcs:
        raise ConfigError(["no dataset: set dataset_name (a hub name, a local .jsonl/.parquet/.csv file or "
                           "directory, or ogrpo:tiny) or dataset_mixture"], "dataset_name")
    want = {prompt_column: ["the prompt (dataset_prompt_column)"], **needed}
    for src in srcs:
        label = f"dataset {src.name!r}" + (f" (split {src.split!r})" if kind != "name" or src.split != "train" else "")
        try:
            cols = builtin_columns(src.name) if _is_builtin(src.name) \
                else columns_of(src)
        except Unreadable as exc:
            warnings.append(f"{label}: columns not checked ({exc}); the trainer checks them when it loads it")
            continue
        except (ValueError, OSError) as exc:
            problems.append(f"{label} {exc}")
            continue
        if src.columns:
            missing_sel = [c for c in src.columns if c not in cols]
            if missing_sel:
                problems.append(f"{label} has no column {', '.join(map(repr, missing_sel))} to select (columns: "
                                f"{', '.join(cols)})")
                continue
            cols = list(src.columns)
        for col, users in want.items():
            if col not in cols:
                fix = "set dataset_prompt_column" if col == prompt_column else f"needed by reward {', '.join(users)}"
                problems.append(f"{label} has no {col!r} column (columns: {', '.join(cols) or 'none'}); {fix}")
        path = Path(src.name).expanduser()
        if prompt_column in cols and path.is_file() and path.suffix.lower() == ".jsonl":
            bad = jsonl_problem(path, prompt_column)
            if bad:
                problems.append(f"{label} {bad}")
    if problems:
        raise ConfigError(problems, "dataset")
    return warnings
