"""Prompt data for the trainer: the recipe's datasets (see data_sources.py) loaded with `datasets`, laid out
as TRL's GRPOTrainer expects (a `prompt` column; every other column reaches the reward functions).

Prompt layout:
- open-r1 recipes (`dataset_prompt_column` or `system_prompt` set): open-r1's `make_conversation`, i.e.
  prompt = [{"role": "system", "content": system_prompt}] (if set) + [{"role": "user", "content": row[column]}];
  a `messages` column is dropped, as open-r1's grpo.py does.
- otherwise TRL's: the `prompt` column as it is (text or conversation), `ogrpo.prompt_column` renaming another
  column to it and `ogrpo.system_prompt` prepending a system message.
"""

from __future__ import annotations

from pathlib import Path

from ogrpo import tiny
from ogrpo.errors import OgrpoError
from ogrpo.tasks import task_dataset
from ogrpo.trainer.data_sources import FILE_BUILDERS, SAVED_MARKERS, Source, is_local, sources


def _load(src: Source):
    import datasets

    path = Path(src.name).expanduser()
    if path.is_file():
        builder = FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise OgrpoError(f"dataset {src.name}: unknown file type {path.suffix!r}; use .jsonl, .json, .parquet "
                             "or .csv")
        if not path.read_bytes().strip():
            raise OgrpoError(f"dataset {src.name} is empty (no rows); point dataset_name at a file with prompts")
        kwargs = {"delimiter": "\t"} if path.suffix.lower() == ".tsv" else {}
        return datasets.load_dataset(builder, data_files=str(path), split="train", **kwargs)
    if path.is_dir() and any((path / m).is_file() for m in SAVED_MARKERS):
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if src.split not in ds:
                raise OgrpoError(f"dataset {src.name} has no split {src.split!r} (splits: {', '.join(ds)}); set "
                                 "dataset_train_split")
            return ds[src.split]
        return ds
    if not path.exists() and is_local(src.name):
        raise OgrpoError(f"dataset {src.name} does not exist; fix dataset_name (a hub name or a local "
                         "file/directory)")
    return datasets.load_dataset(str(path) if path.is_dir() else src.name, src.config, split=src.split,
                                 data_files=src.data_files, data_dir=src.data_dir)


def _open_r1_mixture(srcs: list[Source], mix: dict, train_split: str):
    """open-r1's get_dataset: each dataset's columns selected, `weight` share of its (seeded) shuffled rows kept,
    all concatenated and shuffled; `test_split_size` splits off a test set (the train part is trained on)."""
    from datasets import concatenate_datasets

    seed = int(mix.get("seed") or 0)
    parts = []
    for src in srcs:
        ds = _load(src)
        if src.columns is not None:
            ds = ds.select_columns(src.columns)
        if src.weight is not None:
            ds = ds.shuffle(seed=seed).select(range(int(len(ds) * float(src.weight))))
        parts.append(ds)
    try:
        ds = concatenate_datasets(parts).shuffle(seed=seed)
    except ValueError as exc:  # different features: the columns of the mixture's datasets must agree
        raise OgrpoError(f"dataset_mixture: cannot concatenate ({exc}); select the same columns from each dataset "
                         "(columns: [...])") from None
    if mix.get("test_split_size") is not None:
        return ds.train_test_split(test_size=mix["test_split_size"], seed=seed)["train"]
    return ds


def _trl_mixture(trl: dict, train_split: str):
    from trl import DatasetMixtureConfig, get_dataset
    from trl.scripts.utils import DatasetConfig

    # streaming stays off: O-GRPO loads datasets in memory (ogrpo/fields.py lists `streaming` as unsupported)
    config = DatasetMixtureConfig(datasets=[DatasetConfig(**d) for d in trl["datasets"]], streaming=False,
                                  test_split_size=trl.get("test_split_size"))
    dd = get_dataset(config)
    if train_split not in dd:
        raise OgrpoError(f"datasets mixture has no split {train_split!r} (splits: {', '.join(dd)}); set "
                         "dataset_train_split")
    return dd[train_split]


def load_dataset_for(trl: dict):
    """The recipe's training split, before the prompt layout."""
    kind, srcs = sources(trl)
    if not srcs:
        raise OgrpoError("no dataset: set dataset_name in the run config (a hub name, a local .jsonl/.parquet/.csv "
                         "file, or ogrpo:tiny) or dataset_mixture")
    if kind == "name" and tiny.is_tiny(srcs[0].name):
        return tiny.toy_dataset()
    if kind == "name" and srcs[0].name.startswith("ogrpo:"):
        return task_dataset(srcs[0].name)
    import datasets

    datasets.disable_progress_bars()
    train_split = trl.get("dataset_train_split") or "train"
    try:
        if kind == "open-r1 mixture":
            return _open_r1_mixture(srcs, trl["dataset_mixture"], train_split)
        if kind == "TRL mixture":
            return _trl_mixture(trl, train_split)
        return _load(srcs[0])
    except OgrpoError:
        raise
    except Exception as exc:  # datasets raises many types (FileNotFound, DatasetNotFound, ValueError, ...)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise OgrpoError(f"dataset {srcs[0].name!r}: cannot load ({type(exc).__name__}: {first}); check "
                         "dataset_name, dataset_config and dataset_train_split") from None


def prompt_settings(trl: dict, prompt_column: str | None = None, system_prompt: str | None = None):
    """(column, system prompt, open-r1 layout?) from the recipe's open-r1 keys, else the ogrpo options."""
    open_r1 = trl.get("dataset_prompt_column") is not None or trl.get("system_prompt") is not None
    column = trl.get("dataset_prompt_column") or prompt_column or "prompt"
    system = trl.get("system_prompt") if trl.get("system_prompt") is not None else system_prompt
    return column, system, open_r1


def _is_conversation(value) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value)


def chat_prompts(ds) -> bool:
    """Whether a laid-out dataset's prompts are chat messages (TRL renders them with the tokenizer's chat
    template), from its schema."""
    feat = ds.features.get("prompt") if hasattr(ds, "features") else None
    return feat is not None and type(feat).__name__ != "Value"


def prompt_column_problem(ds, column: str) -> str | None:
    """What is wrong with a loaded dataset's prompt column for TRL (whose tokenizer and chat template fail on it
    at the first step, with a traceback): values that are neither text nor chat messages, or missing ones. Read
    from the schema and Arrow's null count: no row is visited."""
    feat = ds.features[column]
    dtype = getattr(feat, "dtype", None)
    if type(feat).__name__ == "Value":
        if dtype not in ("string", "large_string"):
            return f"holds {dtype} values"
    else:
        inner = feat[0] if isinstance(feat, list) else getattr(feat, "feature", None)
        if not (isinstance(inner, dict) and "role" in inner and "content" in inner):
            return f"holds {feat}"
    nulls = ds.data.column(column).null_count
    return f"has {nulls} empty (null) value{'s' if nulls != 1 else ''}" if nulls else None


def load_prompts(trl: dict, prompt_column: str | None = None, system_prompt: str | None = None):
    """The training dataset with a `prompt` column, as TRL's GRPOTrainer expects."""
    ds = load_dataset_for(trl)
    name = trl.get("dataset_name") or "dataset_mixture"
    column, system, open_r1 = prompt_settings(trl, prompt_column, system_prompt)
    if column not in ds.column_names:
        cols = ", ".join(ds.column_names) or "none"
        key = "dataset_prompt_column" if open_r1 else "ogrpo.prompt_column"
        raise OgrpoError(f"dataset {name!r} has no {column!r} column (columns: {cols}); set {key} to the column "
                         "that holds the prompt")
    if len(ds) == 0:
        raise OgrpoError(f"dataset {name!r} (split {trl.get('dataset_train_split') or 'train'!r}) has no rows; "
                         "point dataset_name at a non-empty file or split")
    problem = prompt_column_problem(ds, column)
    if problem:
        raise OgrpoError(f"dataset {name!r}: column {column!r} {problem}; a prompt is text or a list of chat "
                         "messages ({role, content})")
    head = [{"role": "system", "content": system}] if system else []

    if open_r1:
        def make_conversation(row):
            value = row[column]
            return {"prompt": head + (list(value) if _is_conversation(value) else
                                      [{"role": "user", "content": value}])}

        ds = ds.map(make_conversation)
        return ds.remove_columns("messages") if "messages" in ds.column_names else ds

    if column != "prompt":
        if "prompt" in ds.column_names:
            ds = ds.remove_columns("prompt")
        ds = ds.rename_column(column, "prompt")
    if head:
        def to_chat(row):
            p = row["prompt"]
            return {"prompt": head + (list(p) if _is_conversation(p) else [{"role": "user", "content": p}])}

        ds = ds.map(to_chat)
    return ds
