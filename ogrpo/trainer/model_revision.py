"""The hub commit a run's model came from, recorded in the run's manifest (`model_revision`) so that `ogrpo
reproduce` loads the same weights: a hub name, or a branch or tag in `model_revision`, may point at other commits
later. A local directory or a built-in model has no commit (None): the path is the record.

Read from the HF cache only, after the tokenizer's load (which resolved the revision and wrote the cache's
`refs/`): asking the hub again would wait out huggingface_hub's retries (over 20 s) on a cluster without network.
"""

from __future__ import annotations

import re
from pathlib import Path

COMMIT = re.compile(r"[0-9a-f]{40}")


def hub_commit(model_path: str, revision: str | None) -> str | None:
    """The commit `model_path` at `revision` resolves to in the HF cache (the snapshot transformers loads), else
    None (a local directory; nothing cached for it)."""
    if Path(model_path).expanduser().is_dir():
        return None
    from huggingface_hub import constants  # the cache transformers reads (HF_HUB_CACHE, HF_HOME)

    repo = Path(constants.HF_HUB_CACHE) / ("models--" + model_path.replace("/", "--"))
    wanted = revision or "main"
    try:
        commit = wanted if COMMIT.fullmatch(wanted) else (repo / "refs" / wanted).read_text().strip()
        return commit if COMMIT.fullmatch(commit) and (repo / "snapshots" / commit).is_dir() else None
    except (OSError, ValueError):  # no such ref, a cache this user cannot read, a ref path out of the cache
        return None
