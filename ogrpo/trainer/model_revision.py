"""The hub commit a run's model came from, recorded in the run's manifest (`model_revision`) so that `ogrpo
reproduce` loads the same weights: a hub name, or a branch or tag in `model_revision`, may point at other commits
later. A local directory or a built-in model has no commit (None): the path is the record.
"""

from __future__ import annotations

from pathlib import Path


def hub_commit(model_path: str, revision: str | None) -> str | None:
    """The commit `model_path` at `revision` resolves to (the hub's snapshot that transformers loads), else None
    (a local directory; a hub unreachable with nothing cached, which the model's own load then reports)."""
    if Path(model_path).expanduser().is_dir():
        return None
    from huggingface_hub import hf_hub_download

    try:  # the file transformers reads first; offline, or with no network, the cache's snapshot answers
        config = Path(hf_hub_download(model_path, "config.json", revision=revision or None))
    except Exception:  # noqa: BLE001 - huggingface_hub raises many types; the model's load says what is wrong
        return None
    return config.parent.name if config.parent.parent.name == "snapshots" else None
