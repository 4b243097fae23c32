"""Files other processes poll (run/roles/*.json, local/state.json, the sweep manifest) are replaced whole."""
import json
import multiprocessing as mp
import os

import pytest

from ogrpo import atomic_file


def _rewrite(path, n):
    for i in range(n):
        atomic_file.write_json(path, {"pid": i, "pad": "x" * 4096})


def test_a_polling_reader_never_sees_a_partial_record_and_globs_never_see_the_temporary(tmp_path):
    path = tmp_path / "roles" / "trainer.json"
    atomic_file.write_json(path, {"pid": -1})
    writer = mp.get_context("fork").Process(target=_rewrite, args=(path, 3000))
    writer.start()
    reads, names = 0, set()
    while writer.is_alive() or reads == 0:
        names.update(p.name for p in path.parent.glob("*.json"))
        assert "pid" in json.loads(path.read_text())  # an empty or cut file would raise here
        reads += 1
    writer.join()
    assert writer.exitcode == 0 and reads > 10
    assert names == {"trainer.json"} and [p.name for p in path.parent.iterdir()] == ["trainer.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "state.json"
    atomic_file.write_json(path, {"state": "RUNNING"}, fsync=True)
    with pytest.raises(TypeError):
        atomic_file.write_json(path, {"state": object()})
    assert json.loads(path.read_text()) == {"state": "RUNNING"}
    (tmp_path / "busy.json").mkdir()  # the replace itself fails, after the temporary file was written
    with pytest.raises(OSError):
        atomic_file.write_text(tmp_path / "busy.json", "{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy.json", "state.json"]


def test_a_record_gets_the_mode_a_plain_write_would_give_not_a_private_one(tmp_path):
    old = os.umask(0o027)
    try:
        atomic_file.write_json(tmp_path / "manifest.json", {"status": "running"})
        (tmp_path / "plain.json").write_text("{}")
    finally:
        os.umask(old)
    mode = (tmp_path / "manifest.json").stat().st_mode & 0o777
    assert mode == (tmp_path / "plain.json").stat().st_mode & 0o777 == 0o640
