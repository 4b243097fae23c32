"""ogrpo.launch.slurm.submitit_adapter against the pinned submitit: our command in the batch step (no srun, no pickle),
O-GRPO's overrides of submitit's defaults, job arrays, and a check() that fails when the private renderer moves."""

from __future__ import annotations

import pytest

from ogrpo.launch.slurm import submitit_adapter as sa
from ogrpo.patches.target import PatchTargetMoved

PARAMS = {"nodes": 2, "ntasks_per_node": 1, "cpus-per-task": 16, "gres": "gpu:a40:3", "mem": "64G",
          "time": "01:30:00", "partition": "gpu", "account": "lab", "qos": "high", "signal": "B:USR2@90",
          "requeue": True, "output": "/jobs/a/logs/slurm-%j.out", "exclusive": True, "mail-type": "END",
          "constraint": None}


def test_render_writes_every_option_and_runs_the_command_in_the_batch_step():
    text = sa.render_sbatch("exec python -m ogrpo.launch.slurm supervise /jobs/a", "/jobs/a", job_name="run1",
                            params=PARAMS, setup=["set -euo pipefail"])
    lines = text.splitlines()
    for want in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --cpus-per-task=16",
                 "#SBATCH --gres=gpu:a40:3", "#SBATCH --mem=64G", "#SBATCH --time=01:30:00",
                 "#SBATCH --partition=gpu", "#SBATCH --account=lab", "#SBATCH --qos=high",
                 "#SBATCH --signal=B:USR2@90", "#SBATCH --requeue", "#SBATCH --output=/jobs/a/logs/slurm-%j.out",
                 "#SBATCH --exclusive", "#SBATCH --mail-type=END", "#SBATCH --job-name=run1",
                 "#SBATCH --open-mode=append", "set -euo pipefail",
                 "exec python -m ogrpo.launch.slurm supervise /jobs/a"):
        assert want in lines, (want, text)
    # submitit's own defaults that O-GRPO does not want: srun around the command, its log names, wckey, a 5-minute
    # limit; a None option is left out
    for bad in ("srun", "--wckey", "--error", "_log.out", "--constraint", "--signal=USR2"):
        assert bad not in text, (bad, text)
    assert lines.index("set -euo pipefail") > max(i for i, ln in enumerate(lines) if ln.startswith("#SBATCH"))
    no_time = sa.render_sbatch("true", "/j", job_name="x", params={"output": "/j/o-%j"})
    assert "--time" not in no_time and "--nodes" not in no_time  # the site's defaults apply


def test_array_renders_tasks_and_parallelism_and_per_task_logs():
    text = sa.render_sbatch("true", "/j", job_name="sweep", params={"output": "/j/logs/slurm-%j.out"},
                            array=(4, 2))
    assert "#SBATCH --array=0-3%2" in text.splitlines()
    assert "#SBATCH --output=/j/logs/slurm-%A_%a.out" in text.splitlines()
    # at most as many running as there are tasks
    assert "#SBATCH --array=0-2%3" in sa.render_sbatch("true", "/j", job_name="s", params={}, array=(3, 8))


def test_check_passes_on_the_pinned_submitit_and_fails_when_a_parameter_goes(monkeypatch):
    sa.check()
    from submitit.slurm import slurm

    real = slurm._make_sbatch_string

    def renamed(command, folder, job_name="submitit", additional_parameters=None, use_srun=True, **kw):
        return real(command, folder, job_name=job_name, additional_parameters=additional_parameters,
                    use_srun=use_srun)

    monkeypatch.setattr(slurm, "_make_sbatch_string", renamed)
    with pytest.raises(PatchTargetMoved, match=r"submitit_adapter .*lost its `setup` parameter"):
        sa.check()


def test_check_fails_when_the_rendering_changes(monkeypatch):
    from submitit.slurm import slurm

    real = slurm._make_sbatch_string
    monkeypatch.setattr(slurm, "_make_sbatch_string",
                        lambda *a, **kw: real(*a, **kw).replace("#SBATCH --requeue", "#SBATCH --no-requeue"))
    with pytest.raises(PatchTargetMoved, match="lacks `#SBATCH --requeue`"):
        sa.check()


def test_watcher_asks_sacct_for_our_fields_and_reads_steps():
    job = sa.job("/tmp", "4242")
    cmd = job.job.watcher._make_command()
    assert cmd[:1] == ["sacct"] and cmd[cmd.index("-o") + 1] == sa.SACCT_FIELDS and "4242" in cmd
    job.job.watcher._output = (b"JobID|JobName|State|ExitCode|Elapsed|NodeList|WorkDir\n"
                               b"4242|ogrpo|RUNNING|0:0|00:01:00|n1|/jobs/a\n"
                               b"4242.batch|batch|RUNNING|0:0|00:01:00|n1|\n"
                               b"4242.0|trainer|COMPLETED|0:0|00:00:30|n1|\n")
    job.job.watcher._info_dict.update(job.job.watcher.read_info(job.job.watcher._output))
    assert job.state(fresh=False) == "RUNNING" and job.info(fresh=False)["WorkDir"] == "/jobs/a"
    assert [s["id"] for s in job.steps()] == ["4242.batch", "4242.0"] and job.steps()[1]["name"] == "trainer"
