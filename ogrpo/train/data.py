"""Prompt data: the built-in toy set, local JSONL/JSON/Parquet/CSV files or saved datasets, or hub names.

Everything goes through `datasets`, so what works with TRL's own scripts works here. Checks (prompt column,
at least one row) run before the run directory is created.
"""

from __future__ import annotations

from pathlib import Path

from ogrpo.errors import OgrpoError

_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".tsv": "csv"}


def _load(name: str, config: str | None, split: str):
    import datasets

    datasets.disable_progress_bars()
    path = Path(name).expanduser()
    if path.is_file():
        builder = _FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise OgrpoError(f"dataset {name}: unknown file type {path.suffix!r}; use .jsonl, .json, .parquet or .csv")
        if not path.read_bytes().strip():
            raise OgrpoError(f"dataset {name} is empty (no rows); point dataset_name at a file with prompts")
        kwargs = {"delimiter": "\t"} if path.suffix.lower() == ".tsv" else {}
        return datasets.load_dataset(builder, data_files=str(path), split="train", **kwargs)
    if path.is_dir():
        if (path / "dataset_info.json").is_file() or (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            ds = datasets.load_from_disk(str(path))
            return ds[split] if isinstance(ds, datasets.DatasetDict) else ds
        return datasets.load_dataset(str(path), config, split=split)
    if name.startswith(("/", ".", "~")):
        raise OgrpoError(f"dataset {name} does not exist; fix dataset_name (a hub name or a local file/directory)")
    return datasets.load_dataset(name, config, split=split)


def load_prompts(trl: dict, prompt_column: str | None = None, system_prompt: str | None = None):
    """The training dataset with a `prompt` column, as TRL's GRPOTrainer expects."""
    from ogrpo import tiny

    name = trl.get("dataset_name")
    if not name:
        raise OgrpoError("no dataset: set dataset_name in the run config (a hub name, a local .jsonl/.parquet/.csv "
                         "file, or ogrpo:tiny)")
    split = trl.get("dataset_train_split") or "train"
    if tiny.is_tiny(name):
        ds = tiny.toy_dataset()
    else:
        try:
            ds = _load(str(name), trl.get("dataset_config"), split)
        except OgrpoError:
            raise
        except Exception as exc:  # datasets raises many types (FileNotFound, DatasetNotFound, ValueError, …)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise OgrpoError(f"dataset {name!r}: cannot load ({type(exc).__name__}: {first}); check dataset_name, "
                             "dataset_config and dataset_train_split") from None
    column = prompt_column or "prompt"
    if column not in ds.column_names:
        cols = ", ".join(ds.column_names) or "none"
        raise OgrpoError(f"dataset {name!r} has no {column!r} column (columns: {cols}); set ogrpo.prompt_column "
                         "to the column that holds the prompt")
    if len(ds) == 0:
        raise OgrpoError(f"dataset {name!r} (split {split!r}) has no rows; point dataset_name at a non-empty file "
                         "or split")
    if column != "prompt":
        if "prompt" in ds.column_names:
            ds = ds.remove_columns("prompt")
        ds = ds.rename_column(column, "prompt")
    if system_prompt:
        def to_chat(row):
            p = row["prompt"]
            if isinstance(p, str):
                p = [{"role": "user", "content": p}]
            return {"prompt": [{"role": "system", "content": system_prompt}, *p]}

        ds = ds.map(to_chat)
    return ds
