"""Container wrapping per runtime, detection from PATH / srun, and the CLI-facing errors."""

from __future__ import annotations

import stat

import pytest

from ogrpo.errors import OgrpoError
from ogrpo.jobspec import Step
from ogrpo.launch import containers as c
from ogrpo.launch import slurm as sl

CMD = ["python3", "-m", "ogrpo.train", "--config", "/jobs/a/run.yaml"]


def test_none_leaves_the_command_alone():
    assert c.wrap(None, CMD) == ([], CMD)
    assert c.wrap(c.Container("img", "none"), CMD) == ([], CMD)


@pytest.mark.parametrize("runtime", ["apptainer", "singularity"])
def test_apptainer_wraps_the_command_with_nv_and_binds(runtime):
    srun, argv = c.wrap(c.Container("/images/ogrpo.sif", runtime, ("/jobs/a",)), CMD)
    assert srun == []
    assert argv == [runtime, "exec", "--nv", "--bind", "/jobs/a:/jobs/a", "/images/ogrpo.sif", *CMD]


def test_pyxis_adds_srun_options_and_keeps_the_command():
    srun, argv = c.wrap(c.Container("nvcr.io#org/ogrpo:a40", "pyxis", ("/jobs/a",)), CMD)
    assert srun == ["--container-image=nvcr.io#org/ogrpo:a40", "--container-mounts=/jobs/a:/jobs/a",
                    "--container-workdir=/jobs/a"]
    assert argv == CMD


def _fake_tool(directory, name, script="#!/bin/sh\nexit 0\n"):
    path = directory / name
    path.write_text(script)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_detection_from_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(OgrpoError, match="--container-runtime"):
        c.detect_runtime("/images/ogrpo.sif")
    _fake_tool(tmp_path, "singularity")
    assert c.detect_runtime("/images/ogrpo.sif") == "singularity"
    _fake_tool(tmp_path, "apptainer")
    assert c.detect_runtime("/images/ogrpo.sif") == "apptainer"  # the newer name wins
    # a registry image goes to pyxis when srun has the plugin
    _fake_tool(tmp_path, "srun", "#!/bin/sh\necho '  --container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH'\n")
    assert c.detect_runtime("ghcr.io/org/ogrpo:a40") == "pyxis"
    assert c.detect_runtime("/images/ogrpo.sif") == "apptainer"


def test_make_container_choices(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert c.make_container(None, None, ["/j"]) is None
    assert c.make_container("img.sif", "none", ["/j"]) is None
    box = c.make_container("ghcr.io/org/ogrpo:a40", "apptainer", ["/j"])
    assert box.image == "docker://ghcr.io/org/ogrpo:a40" and box.runtime == "apptainer"
    with pytest.raises(OgrpoError, match="one of apptainer"):
        c.make_container("img.sif", "docker", ["/j"])
    with pytest.raises(OgrpoError, match="needs --container"):
        c.make_container(None, "pyxis", ["/j"])


def test_srun_line_carries_the_container():
    step = Step("trainer", [0], [1, 2], 1, ["accelerate", "launch", "-m", "ogrpo.train", "--output-dir", "{job_dir}/run"])
    hosts = ["n1"]
    values = {"job_dir": "/jobs/a"}
    box = c.Container("/images/ogrpo.sif", "apptainer", ("/jobs/a",))
    argv = sl.srun_argv(step, job_dir="/jobs/a", hosts=hosts, values=values, cpus=4, mem_mb=None, container=box)
    i = argv.index("apptainer")
    assert argv[0] == "srun" and "--gres=gpu:2" in argv[:i]
    # inside the image the step wrapper is the image's python, then the filled command
    assert argv[i:i + 6] == ["apptainer", "exec", "--nv", "--bind", "/jobs/a:/jobs/a", "/images/ogrpo.sif"]
    assert argv[i + 6] == "python3" and argv[-1] == "/jobs/a/run"
    pyx = sl.srun_argv(step, job_dir="/jobs/a", hosts=hosts, values=values, cpus=4, mem_mb=None,
                       container=c.Container("org/ogrpo:a40", "pyxis", ("/jobs/a",)))
    assert "--container-image=org/ogrpo:a40" in pyx[:pyx.index("python3")]
