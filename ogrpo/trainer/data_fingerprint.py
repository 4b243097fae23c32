"""The fingerprint of the prompts a run trains on: a SHA-256 of the dataset's rows as TRL receives them (after the
prompt layout), recorded in the run's manifest (`data`), compared where the recipe pins it (`ogrpo.data_sha256`,
which `ogrpo reproduce` sets to the recorded run's) and when a run resumes.

Why the rows and not the files: a hub dataset has no file here to hash, a mixture is a seeded selection of several,
and a local file may be rewritten with the same rows. The hash reads the Arrow data in fixed batches of rows, each
written as one Arrow IPC record batch after the stream's schema (the columns' names and Arrow types) but without
the schema's metadata, which holds `datasets`' own cache fingerprint (different for every load) and its feature
names (which `datasets` releases spell differently). So the same rows in the same order give the same hash however
`datasets` chunked or cached them, and a shuffled selection hashes as its rows in order.
"""

from __future__ import annotations

from ogrpo.errors import OgrpoError

BATCH = 8192  # rows per hashed record batch: part of the definition, never to be changed


def fingerprint(ds) -> dict:
    """{"rows": N, "sha256": hex} of a `datasets.Dataset`."""
    import hashlib
    import io

    import pyarrow as pa

    digest = hashlib.sha256()
    arrow = ds.with_format("arrow")
    sink, writer = io.BytesIO(), None
    for start in range(0, len(ds), BATCH):
        table = arrow[start:start + BATCH].combine_chunks().replace_schema_metadata(None)
        if writer is None:
            writer = pa.ipc.new_stream(sink, table.schema)
        for batch in table.to_batches():
            writer.write_batch(batch)
        digest.update(sink.getbuffer())
        sink.seek(0)
        sink.truncate()
    if writer is not None:
        writer.close()
        digest.update(sink.getbuffer())
    return {"rows": len(ds), "sha256": digest.hexdigest()}


def check_pinned(found: dict, pinned: str | None, name: str) -> None:
    """Refuse data other than the recipe's pin (`ogrpo.data_sha256`), before the model loads."""
    if pinned is not None and found["sha256"] != pinned.lower():
        raise OgrpoError(f"dataset {name!r}: its {found['rows']} rows hash to {found['sha256'][:16]}..., not to the "
                         f"ogrpo.data_sha256 the run config pins ({pinned[:16]}...): the data changed since the "
                         "recorded run (or a datasets/pyarrow release reads it differently); restore it, or drop the "
                         "pin to train on the data as it is now")


def resumed_note(found: dict, recorded: dict | None) -> str | None:
    """A note where a resumed run's data differs from what the run trained on before (its manifest's `data`)."""
    if not recorded or recorded.get("sha256") in (None, found["sha256"]):
        return None
    return (f"the dataset changed since this run started ({recorded.get('rows')} rows, "
            f"{str(recorded['sha256'])[:16]}... then; {found['rows']} rows, {found['sha256'][:16]}... now): the "
            "resumed steps train on the data as it is now")
