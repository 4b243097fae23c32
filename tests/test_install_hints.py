"""A login node with only the core install: commands that need the training stack say what to install in one
line (exit 2), never a traceback, and write nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Makes the named top-level modules unimportable in the child, as on a machine without them.
BLOCK = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, _Block())
sys.argv = ['ogrpo', *{argv!r}]
from ogrpo.cli import main
main()
"""


def run_without(blocked: set[str], *argv: str, cwd=None) -> subprocess.CompletedProcess:
    code = BLOCK.format(blocked=blocked, argv=list(argv))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=120)


@pytest.mark.parametrize("argv, blocked, names", [
    (("train", "--config", "tiny"), {"torch", "transformers", "trl", "tokenizers"}, "ogrpo[train]"),
    (("submit", "--backend", "local", "--gpus", "cpu", "--config", "tiny"), {"torch", "trl", "accelerate"},
     "ogrpo[train]"),
    (("bench", "rollout", "--repeats", "1"), {"torch", "vllm"}, "pip install"),
])
def test_missing_training_stack_is_one_line(tmp_path, argv, blocked, names):
    job = ("-o", str(tmp_path / "job")) if argv[0] == "submit" else ()
    out = run_without(blocked, *argv, *job, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    err = out.stderr.strip()
    assert "Traceback" not in err and err.count("\n") == 0, err
    assert "not installed here" in err and names in err
    assert not (tmp_path / "job").exists() and not (tmp_path / "runs").exists()


def test_a_real_bug_is_not_disguised_as_an_install_hint():
    from ogrpo.install_hints import hint

    assert hint("torch.nn") is not None
    assert hint("ogrpo.something") is None and hint(None) is None
