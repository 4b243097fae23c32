"""The trainer entry point (`ogrpo train`, `python -m ogrpo.train`, `accelerate launch -m ogrpo.train`).

Heavy imports (torch, transformers, trl, datasets) happen inside functions, never at package import.
"""

from __future__ import annotations

from ogrpo.errors import OgrpoError


def parse_overrides(items) -> dict:
    """`KEY=VALUE` strings → dict, values parsed as YAML scalars (`max_steps=5`, `bf16=false`, `ogrpo.x=1`)."""
    import yaml

    out: dict = {}
    for item in items or []:
        key, sep, raw = str(item).partition("=")
        if not sep or not key.strip():
            raise OgrpoError(f"--set {item!r}: write KEY=VALUE (e.g. --set max_steps=10)")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        if isinstance(value, bool) and raw.strip().lower() not in ("true", "false"):
            value = raw.strip()  # YAML 1.1 reads `no`/`off` as False; `save_strategy=no` means the string
        out[key.strip()] = value
    return out
