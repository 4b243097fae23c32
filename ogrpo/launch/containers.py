"""Wrap a step's command for the site's container runtime: Apptainer/Singularity, pyxis/enroot, or none.

Apptainer wraps the command itself (`apptainer exec --nv IMAGE cmd`); pyxis is an `srun` plugin, so it adds
options to the `srun` line (`--container-image`) and leaves the command alone. That is why `wrap` returns
both parts. Pure except `detect_runtime`, which looks at PATH and at `srun --help`.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

from ogrpo.errors import OgrpoError

RUNTIMES = ("apptainer", "singularity", "pyxis", "none")


@dataclass(frozen=True)
class Container:
    image: str
    runtime: str  # one of RUNTIMES
    binds: tuple[str, ...] = ()  # host paths the step must see (the job dir): same path inside

    def wrap(self, argv: list[str]) -> tuple[list[str], list[str]]:
        """(extra srun options, command) for one step."""
        return wrap(self, argv)


def wrap(container: Container | None, argv: list[str]) -> tuple[list[str], list[str]]:
    if container is None or container.runtime == "none":
        return [], list(argv)
    if container.runtime in ("apptainer", "singularity"):
        # --nv binds the host driver and the devices Slurm left visible (CUDA_VISIBLE_DEVICES passes through)
        binds = [a for b in container.binds for a in ("--bind", f"{b}:{b}")]
        return [], [container.runtime, "exec", "--nv", *binds, container.image, *argv]
    if container.runtime == "pyxis":
        opts = [f"--container-image={container.image}"]
        if container.binds:
            opts.append("--container-mounts=" + ",".join(f"{b}:{b}" for b in container.binds))
        # the job dir is the working directory of every step; pyxis would otherwise start in the image's WORKDIR
        opts.append("--container-workdir=" + (container.binds[0] if container.binds else "/"))
        return opts, list(argv)
    raise ValueError(f"unknown container runtime {container.runtime!r}")


def _srun_has_pyxis() -> bool:
    srun = shutil.which("srun")
    if not srun:
        return False
    try:
        out = subprocess.run([srun, "--help"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--container-image" in out


def detect_runtime(image: str) -> str:
    """Pick the runtime for IMAGE: a .sif file or a local path → apptainer/singularity; a registry reference or
    a .sqsh → pyxis when srun has the plugin, else apptainer (which pulls docker:// itself)."""
    local_image = image.endswith((".sif", ".simg")) or image.startswith(("/", "./"))
    found = [r for r in ("apptainer", "singularity") if shutil.which(r)]
    pyxis = _srun_has_pyxis()
    if image.endswith(".sqsh") or (not local_image and pyxis):
        if pyxis:
            return "pyxis"
    if found:
        return found[0]
    if pyxis:
        return "pyxis"
    raise OgrpoError(
        f"no container runtime found for --container {image}: install apptainer/singularity or the pyxis srun "
        "plugin on the nodes, or pass --container-runtime apptainer|singularity|pyxis explicitly"
    )


def make_container(image: str | None, runtime: str | None, binds: list[str]) -> Container | None:
    """The Container for `--container IMAGE [--container-runtime R]`, or None when there is none."""
    if runtime is not None and runtime not in RUNTIMES:
        raise OgrpoError(f"--container-runtime {runtime!r} is not one of {', '.join(RUNTIMES)}")
    if not image:
        if runtime not in (None, "none"):
            raise OgrpoError(f"--container-runtime {runtime} needs --container IMAGE")
        return None
    if runtime == "none":
        return None
    if runtime in (None, ""):
        runtime = detect_runtime(image)
    if runtime in ("apptainer", "singularity") and image.startswith(("docker.io/", "nvcr.io/", "ghcr.io/")):
        image = "docker://" + image
    return Container(image=image, runtime=runtime, binds=tuple(binds))
