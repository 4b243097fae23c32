"""The extension builder and `python -m ogrpo.kernels build` on a toy kernel in a temp tree: one real compile
(torch's JIT builder + the machine's g++), then the cached and prebuilt paths that jobs and images take."""

from __future__ import annotations

import shutil
import time

import pytest

from ogrpo.kernels import _build
from ogrpo.kernels import __main__ as cli

# plain pybind11 (no torch/extension.h): the builder's flags and cache are under test, not ATen; ~10 s on 2 cores
TOY_CPP = r"""
#include <pybind11/pybind11.h>
#include "toy_common.h"
int twice(int x) { return kFactor * x; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("twice", &twice); }
"""


@pytest.fixture()
def toy_tree(tmp_path, monkeypatch):
    kernels = tmp_path / "kernels"
    csrc = kernels / "toy" / "csrc"
    csrc.mkdir(parents=True)
    (csrc / "toy_cpu.cpp").write_text(TOY_CPP)
    (csrc / "toy_common.h").write_text("constexpr int kFactor = 2;\n")
    (kernels / "other" / "csrc").mkdir(parents=True)  # a kernel whose sources have not landed
    monkeypatch.setattr(_build, "KERNELS_DIR", kernels)
    monkeypatch.setattr(_build, "KERNELS", ("toy", "other"))
    monkeypatch.setenv("OGRPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("OGRPO_KERNELS_PREBUILT", raising=False)
    _build.load_extension.cache_clear()
    yield csrc
    _build.load_extension.cache_clear()


def test_key_follows_every_source_and_header(toy_tree):
    key = _build.build_key("toy", cuda=False)
    assert key.startswith("toy-torch") and "-cpu-" in key
    (toy_tree / "toy_common.h").write_text("constexpr int kFactor = 3;\n")
    assert _build.build_key("toy", cuda=False) != key  # a header edit rebuilds
    assert _build.available() == ["toy"]
    assert _build.available(cuda=True) == []
    with pytest.raises(FileNotFoundError, match="no sources for kernel 'other'"):
        _build.build_key("other", cuda=False)


def test_cuda_key_follows_the_arch_list(toy_tree, monkeypatch):
    # computing a key compiles nothing: no nvcc needed here
    (toy_tree / "toy_cuda.cu").write_text("// launcher\n")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "7.0")
    v100 = _build.build_key("toy", cuda=True)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.6")
    a40 = _build.build_key("toy", cuda=True)
    assert v100 != a40 and "-cuda" in v100
    cpu = _build.build_key("toy", cuda=False)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "7.0")
    assert _build.build_key("toy", cuda=False) == cpu  # the CPU module does not depend on it
    assert _build.available(cuda=True) == ["toy"]


@pytest.mark.slow
def test_build_then_cached_then_prebuilt(toy_tree, tmp_path, capsys):
    assert cli.main(["build"]) == 0
    out = capsys.readouterr().out
    assert "skip   other: no .cpp sources yet" in out
    line = next(ln for ln in out.splitlines() if "toy (cpu)" in ln)
    assert line.startswith("built  toy (cpu) in ")
    so = _build.built_module("toy", cuda=False)
    assert so is not None and so.parent == _build.build_dir("toy", cuda=False) and str(so) in line
    assert _build.load_extension("toy").twice(21) == 42

    # a second build finds the module under the same key and compiles nothing
    _build.load_extension.cache_clear()
    t0 = time.perf_counter()
    assert cli.main(["build", "--kernel", "toy"]) == 0
    assert time.perf_counter() - t0 < 2.0
    assert capsys.readouterr().out.splitlines()[-1].startswith("cached toy (cpu)")

    # an image's read-only prebuilt dir is searched first; no build directory is written to
    prebuilt = tmp_path / "prebuilt"
    shutil.copytree(so.parent, prebuilt / so.parent.name)
    shutil.rmtree(_build.cache_root())
    (prebuilt / so.parent.name).chmod(0o555)
    try:
        import os

        os.environ["OGRPO_KERNELS_PREBUILT"] = str(prebuilt)
        _build.load_extension.cache_clear()
        assert _build.built_module("toy", cuda=False) == prebuilt / so.parent.name / so.name
        assert _build.load_extension("toy").twice(4) == 8
        assert not _build.cache_root().exists()
    finally:
        os.environ.pop("OGRPO_KERNELS_PREBUILT", None)
        (prebuilt / so.parent.name).chmod(0o755)


@pytest.mark.slow
def test_build_into_an_output_dir(toy_tree, tmp_path, capsys):
    out_dir = tmp_path / "wheels" / "kernels"
    assert cli.main(["build", "--out", str(out_dir)]) == 0
    assert (out_dir / _build.build_key("toy", False) / "ogrpo_toy_cpu.so").is_file()
    assert not _build.cache_root().exists()


@pytest.mark.slow
def test_build_reports_a_compiler_error_and_bad_names(toy_tree, capsys):
    (toy_tree / "toy_cpu.cpp").write_text(TOY_CPP.replace("return kFactor * x;", "return x +;"))
    assert cli.main(["build"]) == 1
    assert "FAILED toy (cpu):" in capsys.readouterr().err
    assert cli.main(["build", "--kernel", "nope"]) == 2
    assert "unknown kernel nope; known: toy, other" in capsys.readouterr().err
    assert cli.main(["build", "--kernel", "other"]) == 2
    assert "no sources for other" in capsys.readouterr().err
    # torch here is a CPU build: --cuda says so instead of failing inside nvcc
    assert cli.main(["build", "--cuda"]) == 2
    assert "--cuda needs a CUDA build of torch" in capsys.readouterr().err
