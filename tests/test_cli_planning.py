"""`ogrpo plan`, `render`, `doctor` through the real executable: output, exit codes 0/3/2, nothing written on
error, no tracebacks."""

from __future__ import annotations

import json
import os
import subprocess

import pytest


def _no_traceback(proc):
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout


def test_help_lists_commands(run_cli):
    proc = run_cli("--help", check_rc=0)
    for cmd in ("plan", "render", "doctor"):
        assert cmd in proc.stdout
    for opt in ("--gpus", "--config", "--model", "--params", "--profile", "--vllm-gpus", "--json"):
        assert opt in run_cli("plan", "--help", check_rc=0).stdout
    rhelp = run_cli("render", "--help", check_rc=0).stdout
    assert "--output" in rhelp and "--dry-run" in rhelp


def test_plan_table_fits(run_cli, basic_recipe):
    proc = run_cli("plan", "--gpus", "3xA40", "--config", basic_recipe, check_rc=0)
    assert "vLLM server" in proc.stdout and "trainer" in proc.stdout and "fits" in proc.stdout
    assert "flash_attention_2" in proc.stdout


def test_plan_json(run_cli, basic_recipe):
    proc = run_cli("plan", "--gpus", "3xA40", "--config", basic_recipe, "--json", check_rc=0)
    p = json.loads(proc.stdout)
    assert p["fits"] is True
    for role in ("vllm", "trainer"):
        assert {"nodes", "gpus", "num_gpus", "memory_gib_per_gpu"} <= set(p[role])
    assert p["vllm"]["tensor_parallel_size"] == 1 and p["vllm"]["data_parallel_size"] == 1
    assert p["trainer"]["num_processes"] == 2 and p["trainer"]["strategy"] == "ddp"
    assert p["precision"] == "bf16" and p["attn_implementation"] == "flash_attention_2"


@pytest.mark.slow
def test_plan_no_fit_exit_3(run_cli, basic_recipe):
    proc = run_cli("plan", "--gpus", "1xV100-16G", "--config", basic_recipe, "--model", "Qwen/Qwen2.5-7B-Instruct")
    assert proc.returncode == 3
    assert "does not fit" in proc.stdout and "try:" in proc.stdout
    _no_traceback(proc)
    js = run_cli("plan", "--gpus", "1xV100-16G", "--config", basic_recipe, "--model", "Qwen/Qwen2.5-7B-Instruct",
                 "--json")
    assert js.returncode == 3 and json.loads(js.stdout)["fits"] is False


@pytest.mark.slow
def test_plan_options(run_cli, basic_recipe):
    p = json.loads(run_cli("plan", "--gpus", "4xA40", "--config", basic_recipe, "--vllm-gpus", "2",
                           "--profile", "conservative", "--json", check_rc=0).stdout)
    assert p["vllm"]["gpus"] == [0, 1] and p["profile"] == "conservative"
    p = json.loads(run_cli("plan", "--gpus", "8xA100-80G", "--config", basic_recipe, "--model", "org/new-model",
                           "--params", "3B", "--json", check_rc=0).stdout)
    assert p["model"]["params"] == 3_000_000_000


@pytest.mark.parametrize("args, words", [
    (["--gpus", "3xA4O"], "did you mean A40"),
    (["--gpus", "3*A40"], "malformed"),
    (["--gpus", "0xA40"], "at least 1"),
    (["--gpus", "-2xA40"], "positive"),
    (["--gpus", "3xA40", "--model", "someone/unknown-13b"], "--params"),
    (["--gpus", "3xA40", "--profile", "fast"], "--profile 'fast': choose one of"),
    (["--gpus", "3xA40", "--vllm-gpus", "-1"], "must be 0"),
    (["--gpus", "3xA40", "--params", "lots"], "--params 'lots'"),
    (["--gpus", "3xA40", "--vllm-gpus", "5"], "leaves no trainer GPU"),
])
def test_plan_bad_input_exit_2(run_cli, basic_recipe, args, words):
    proc = run_cli("plan", "--config", basic_recipe, *args)
    assert proc.returncode == 2, proc.stderr
    assert words in proc.stderr
    assert proc.stderr.strip().count("\n") == 0  # one line
    _no_traceback(proc)


@pytest.mark.parametrize("args, words", [
    (["serve", "--config", "tiny", "--port", "99999"], "--port 99999: a TCP port is 1-65535"),
    (["serve", "--config", "tiny", "--port", "0"], "--port 0: a TCP port is 1-65535"),
    (["serve", "--config", "tiny", "--host", "no such host"], "--host 'no such host': this node cannot resolve it"),
    (["submit", "--config", "tiny", "--gpus", "cpu", "--backend", "slurm", "--dry-run", "--signal-delay", "-5"],
     "--signal-delay -5: at least 30 s"),
    (["submit", "--config", "tiny", "--gpus", "cpu", "--backend", "slurm", "--dry-run", "--max-requeues", "-1"],
     "--max-requeues -1: 0 (never requeue) or more"),
    (["sweep", "--config", "tiny", "--gpus", "cpu", "--seeds", "2", "--dry-run", "--max-requeues", "-1"],
     "--max-requeues -1"),
    (["bench", "step", "--hidden", "0"], "too small: --hidden 0 (at least 1)"),
    (["bench", "step", "--generations", "1"], "too small: --generations 1 (at least 2)"),
    (["bench", "step", "--heads", "3"], "hidden 512 must divide by heads 3"),
    (["bench", "rollout", "--prompts", "0", "--tokens", "-5"], "too small: --prompts 0 (at least 1), --tokens -5"),
    (["bench", "rollout", "--repeats", "0"], "too small: --repeats 0"),
    (["train", "--config", "tiny", "--vllm-url", "notaurl"], "--vllm-url 'notaurl': expected http://HOST:PORT"),
    (["train", "--config", "tiny", "--vllm-url", "http://node1:99999"], "--vllm-url 'http://node1:99999'"),
    (["serve", "--config", "tiny", "--dry-run", "--max-model-len", "0"], "--max-model-len 0 < "),
    (["serve", "--config", "tiny", "--dry-run", "--", "--model", "other"], "restates what the plan sets (--model)"),
    (["serve", "--config", "tiny", "--dry-run", "--", "--port=9"], "restates what the plan sets (--port)"),
    (["serve", "--config", "tiny", "--dry-run", "--", "--max_model_len=9000"],
     "restates what the plan sets (--max-model-len)"),
    (["bench", "step", "--gpus", "3xA40"], "--gpus 3xA40: the single placement runs on one GPU"),
    (["bench", "step", "--gpus", "3xFOO"], "unknown GPU type"),
    (["bench", "rollout", "--gpu-memory-utilization", "2"], "--gpu-memory-utilization 2.0: vLLM's share"),
    (["bench", "kernels", "--tokens", "", "--parts", "logprobs"], "--tokens '': the log-prob cases need"),
    (["bench", "rewards", "--cases", "nosuchcase"], "--cases nosuchcase: no case has these in its name"),
    (["selftest", "--no-server", "--ds-ops", "bogus_op"], "--ds-ops bogus_op: not a DeepSpeed op"),
    (["selftest", "--no-server", "--ds-ops", ","], "--ds-ops names no op"),
])
def test_bad_command_line_values_get_one_line_before_any_work(run_cli, tmp_path, monkeypatch, args, words):
    """Values refused at once, in one line, where before they failed after minutes (a bench's model built, vLLM's
    bind after the model loaded) with a traceback, or were clamped without a word."""
    monkeypatch.setenv("OGRPO_JOB_KEY", "k" * 32)  # serve checks its key first
    proc = run_cli(*args, cwd=tmp_path)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], proc.stderr[-2000:]
    _no_traceback(proc)
    assert not list(tmp_path.iterdir())  # nothing written (no run, bench or job directory)


@pytest.mark.parametrize("text, words", [
    ("a: [1,\n", "malformed YAML"),
    ("model_name_or_path: Qwen/Qwen2.5-1.5B\nlearning_rat: 1.0e-6\n", "did you mean learning_rate"),
    ("model_name_or_path: Qwen/Qwen2.5-1.5B\nnum_generations: lots\n", "expected int"),
])
def test_bad_config_exit_2(run_cli, write_recipe, text, words):
    proc = run_cli("plan", "--gpus", "3xA40", "--config", write_recipe(text))
    assert proc.returncode == 2 and words in proc.stderr
    _no_traceback(proc)


def test_missing_config_exit_2(run_cli, tmp_path):
    proc = run_cli("plan", "--gpus", "3xA40", "--config", tmp_path / "missing.yaml")
    assert proc.returncode == 2 and "no such file" in proc.stderr
    _no_traceback(proc)


def test_usage_error_exit_2(run_cli):
    proc = run_cli("plan", "--gpus", "3xA40")  # --config missing
    assert proc.returncode == 2 and "--config is required" in proc.stderr
    _no_traceback(proc)


def test_render_writes_job(run_cli, basic_recipe, tmp_path):
    out = tmp_path / "job"
    proc = run_cli("render", "--gpus", "3xA40", "--config", basic_recipe, "-o", out, check_rc=0)
    assert {p.name for p in out.iterdir()} >= {"job.sbatch", "accelerate.yaml", "run.yaml", "manifest.json", "logs"}
    assert str(out / "job.sbatch") in proc.stdout
    man = json.loads((out / "manifest.json").read_text())
    assert man["jobspec"]["job_dir"] == str(out)


@pytest.mark.slow
def test_render_dry_run_writes_nothing(run_cli, basic_recipe, tmp_path):
    out = tmp_path / "job"
    # 4xV100-16G: DDP's 26.5 GiB per GPU exceed 14.4, so the plan is ZeRO-2 and has a deepspeed.json to show.
    proc = run_cli("render", "--gpus", "4xV100-16G", "--config", basic_recipe, "-o", out, "--dry-run", check_rc=0)
    assert not out.exists()
    for name in ("job.sbatch", "accelerate.yaml", "deepspeed.json", "run.yaml", "manifest.json"):
        assert f"==> {name} <==" in proc.stdout
    # a CPU "device" of a stated size (cpu-8G; plain `cpu` is this host's RAM): 1.5B does not fit, so exit 3
    # with the numbers, and --force shows the job anyway; neither writes anything
    proc = run_cli("render", "--gpus", "cpu-8G", "--config", basic_recipe, "-o", out, "--dry-run")
    assert proc.returncode == 3 and "does not fit" in proc.stderr and "GiB" in proc.stderr
    proc = run_cli("render", "--gpus", "cpu-8G", "--config", basic_recipe, "-o", out, "--dry-run", "--force",
                   check_rc=0)
    assert "==> job.sbatch <==" in proc.stdout and not out.exists()


def test_render_bad_input_writes_nothing(run_cli, basic_recipe, write_recipe, tmp_path):
    out = tmp_path / "job"
    assert run_cli("render", "--gpus", "3xZ9", "--config", basic_recipe, "-o", out).returncode == 2
    assert run_cli("render", "--gpus", "3xA40", "--config", write_recipe("x: [\n", "bad.yaml"),
                   "-o", out).returncode == 2
    nofit = run_cli("render", "--gpus", "1xV100-16G", "--model", "Qwen/Qwen2.5-7B-Instruct", "--config",
                    basic_recipe, "-o", out)
    assert nofit.returncode == 3 and "--force" in nofit.stderr
    assert run_cli("render", "--gpus", "3xA40", "--config", basic_recipe).returncode == 2  # no -o
    assert not out.exists()
    _no_traceback(nofit)


def test_render_force_writes_a_no_fit_job(run_cli, basic_recipe, tmp_path):
    out = tmp_path / "job"
    run_cli("render", "--gpus", "1xV100-16G", "--model", "Qwen/Qwen2.5-7B-Instruct", "--config", basic_recipe,
            "-o", out, "--force", check_rc=0)
    assert "DOES NOT FIT" in (out / "job.sbatch").read_text()


@pytest.mark.slow
def test_doctor_json(run_cli):
    proc = run_cli("doctor", "--json")
    assert proc.returncode in (0, 1)
    rep = json.loads(proc.stdout)
    assert {"python", "torch", "gpus", "trl", "vllm", "stack", "deepspeed", "slurm", "containers",
            "can_train", "patches"} <= set(rep)
    assert rep["python"]["version"]
    # every library this env installs still has the shape O-GRPO's patches were written against
    assert {r["status"] for r in rep["patches"].values()} <= {"ok", "skipped"}, rep["patches"]
    assert (proc.returncode == 0) == rep["can_train"]
    _no_traceback(proc)


# -- start-up cost: a plain `plan` / `render` imports neither typer nor submitit (~160 ms of a login node's wait) --

_MODULES_AFTER = ("import sys\nfrom ogrpo.cli import main\nsys.argv = ['ogrpo', *sys.argv[1:]]\ntry:\n    main()\n"
                  "except SystemExit as exc:\n    code = exc.code\n"
                  "print({'code': code, 'loaded': sorted(m for m in ('typer', 'click', 'submitit', 'torch')"
                  " if m in sys.modules)}, file=sys.stderr)\n")


def _loaded(*args):
    import ast
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _MODULES_AFTER, *map(str, args)], capture_output=True, text=True,
                          timeout=120)
    return ast.literal_eval(proc.stderr.strip().splitlines()[-1])


@pytest.mark.slow
def test_plan_and_render_import_neither_typer_nor_submitit(basic_recipe, tmp_path):
    assert _loaded("plan", "--gpus", "3xA40", "--config", basic_recipe) == {"code": 0, "loaded": []}
    assert _loaded("plan", "--gpus=3xA40", "-c", basic_recipe, "--json") == {"code": 0, "loaded": []}
    assert _loaded("render", "--gpus", "3xA40", "--config", basic_recipe, "--dry-run") == {"code": 0, "loaded": []}
    assert _loaded("render", "--gpus", "3xA40", "--config", basic_recipe, "-o", tmp_path / "j") == \
        {"code": 0, "loaded": []}
    # what the fast path does not read goes to typer, which answers as before
    assert "typer" in _loaded("render", "--help")["loaded"]
    assert _loaded("plan", "--gpus", "3xA40", "--config", basic_recipe, "--vllm-gpus", "x")["code"] == 2


def _typer_kwargs(fn, argv):
    """The keyword arguments typer (as `ogrpo` sets it up) calls fn with for argv."""
    import inspect
    import types

    import typer

    from ogrpo.commands.options import typer_defaults
    from ogrpo.patches import typer_options

    typer_options.install()
    clone = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__)
    clone.__annotations__ = dict(fn.__annotations__)
    typer_defaults(clone)
    seen = {}

    def capture(**kwargs):
        seen.update(kwargs)

    capture.__signature__ = inspect.signature(clone, eval_str=True)
    app = typer.Typer()
    app.command()(capture)
    app.callback()(lambda: None)
    app(["capture", *argv], standalone_mode=False)
    return seen


@pytest.mark.parametrize("argv", [
    ["--gpus", "3xA40", "--config", "r.yaml"],
    ["--gpus=3xA40", "-c", "r.yaml", "--json", "--strict"],
    ["-c", "r.yaml", "--vllm-gpus", "2", "--dry-run", "--force", "-o", "out", "--job-dir", "/j", "--gres-type",
     "any", "--gpus", "2xcpu", "--gpus", "4xV100", "--profile", "aggressive", "--overlap", "one-step"],
    ["--config", "", "--model=Qwen/Qwen2.5-7B", "--params", "7B", "--strategy", "zero3", "--vllm-gpus=0"],
    [],
])
def test_the_fast_parse_reads_what_typer_reads(argv):
    from ogrpo.commands import planning
    from ogrpo.commands.options import fast_kwargs

    render = fast_kwargs(planning.render, argv)
    assert render is not None and render == _typer_kwargs(planning.render, argv)
    plan_argv = [a for a in argv if a not in ("--dry-run", "--force", "-o", "out", "--job-dir", "/j", "--gres-type",
                                             "any")]
    assert fast_kwargs(planning.plan, plan_argv) == _typer_kwargs(planning.plan, plan_argv)


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["--vllm-gpus", "x"], ["--vllm-gpus", "-1"], ["--json=1"],
                                  ["--gpus"], ["extra"], ["-cr.yaml"], ["--"], ["--gpu", "3xA40"],
                                  ["--no-json"]])
def test_the_fast_parse_leaves_anything_else_to_typer(argv):
    from ogrpo.commands import planning
    from ogrpo.commands.options import fast_kwargs

    assert fast_kwargs(planning.render, argv) is None


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_a_terminal_that_is_not_utf8_gets_the_plan(encoding):
    """The plan's table draws with characters ASCII lacks: on such a terminal they are replaced, the plan is shown
    and the exit is 0 (was a UnicodeEncodeError after the plan was made); an error line still reaches it."""
    import sys

    env = dict(os.environ, PYTHONIOENCODING=encoding)
    proc = subprocess.run([sys.executable, "-m", "ogrpo", "plan", "--gpus", "3xA40", "--config", "tiny"],
                          capture_output=True, env=env, timeout=120)
    assert proc.returncode == 0 and b"Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert b"fits" in proc.stdout and b"?" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "ogrpo", "plan", "--gpus", "3xA4O", "--config", "tiny"],
                          capture_output=True, env=env, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("lines, says", [
    ("use_vllm: false\nogrpo:\n  vllm_compile: 'on'\n", "ogrpo.vllm_compile on with use_vllm false"),
    ("use_vllm: false\nogrpo:\n  vllm_gpus: 1\n", "ogrpo.vllm_gpus 1 with use_vllm false"),
    ("vllm_mode: sideways\n", "vllm_mode 'sideways': TRL's modes are server and colocate"),
])
def test_vllm_settings_a_run_cannot_honor_are_refused(run_cli, write_recipe, lines, says):
    """A vLLM setting in a run without vLLM, or a vLLM mode TRL does not have: refused in one line, not dropped
    (nor, for the mode, changed with a reason that does not apply)."""
    recipe = write_recipe("model_name_or_path: ogrpo:tiny\ndataset_name: ogrpo:tiny\nreward_funcs: [tiny_letter]\n"
                          "max_completion_length: 32\n" + lines)
    for gpus in ("3xA40", "2xcpu"):
        proc = run_cli("plan", "--gpus", gpus, "--config", recipe)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    ok = write_recipe("model_name_or_path: ogrpo:tiny\ndataset_name: ogrpo:tiny\nreward_funcs: [tiny_letter]\n"
                      "max_completion_length: 32\nuse_vllm: false\nvllm_mode: colocate\nogrpo:\n  vllm_compile: auto\n",
                      "ok.yaml")
    assert run_cli("plan", "--gpus", "3xA40", "--config", ok).returncode == 0


def test_the_job_trains_the_model_its_plan_is_made_for(run_cli, write_recipe, tmp_path):
    """--model beside a recipe whose model is known here: the job's run.yaml trains --model (a listed change;
    --strict refuses it), not the recipe's model under a plan made for another (the job trained the recipe's
    model before). A recipe model that is not known here (a fine-tune on the compute nodes): --model lends its
    shapes to the plan only, and a warning says the job trains the recipe's."""
    import yaml

    out = tmp_path / "job"
    proc = run_cli("render", "--gpus", "cpu", "--config", "tiny", "--model", "ogrpo:tiny-math", "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert "change: model_name_or_path: 'ogrpo:tiny' -> 'ogrpo:tiny-math' (--model" in proc.stderr
    run = yaml.safe_load((out / "run.yaml").read_text())
    assert run["model_name_or_path"] == "ogrpo:tiny-math"
    assert run["ogrpo"]["plan"]["model"]["name"] == "ogrpo:tiny-math"
    # asked for on the command line: listed, and --strict (changes nobody asked for) takes it; the same two models
    # in the recipe (ogrpo.model beside a known model_name_or_path) are a change --strict refuses
    proc = run_cli("plan", "--gpus", "cpu", "--config", "tiny", "--model", "ogrpo:tiny-math", "--strict")
    assert proc.returncode in (0, 2) and "model_name_or_path would change" not in proc.stderr, proc.stderr
    both = write_recipe("model_name_or_path: ogrpo:tiny\ndataset_name: ogrpo:tiny\nreward_funcs: [tiny_letter]\n"
                        "max_completion_length: 32\nogrpo:\n  model: ogrpo:tiny-math\n", "both.yaml")
    proc = run_cli("plan", "--gpus", "cpu", "--config", both, "--strict")
    assert proc.returncode == 2 and "model_name_or_path would change from 'ogrpo:tiny'" in proc.stderr
    recipe = write_recipe("model_name_or_path: /compute-only/my-finetune\ndataset_name: ogrpo:tiny\n"
                          "reward_funcs: [tiny_letter]\nmax_completion_length: 32\n")
    out = tmp_path / "job2"
    proc = run_cli("render", "--gpus", "3xA40", "--config", recipe, "--model", "Qwen/Qwen2.5-1.5B-Instruct", "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert ("warning: planned with the shapes of Qwen/Qwen2.5-1.5B-Instruct (--model / ogrpo.model): "
            "model_name_or_path /compute-only/my-finetune is not known here") in proc.stderr
    assert yaml.safe_load((out / "run.yaml").read_text())["model_name_or_path"] == "/compute-only/my-finetune"


@pytest.mark.parametrize("args, words", [
    (["plan", "--foo"], "error: No such option: --foo (`ogrpo plan -h` for help)"),
    (["plan", "--config", "tiny", "--vllm-gpus", "x"], "error: Invalid value for '--vllm-gpus': 'x' is not a valid "
                                                       "integer (`ogrpo plan -h` for help)"),
    (["plan", "--config"], "error: Option '--config' requires an argument (`ogrpo plan -h` for help)"),
    (["reproduce"], "error: Missing argument 'run' (`ogrpo reproduce -h` for help)"),
    (["nosuchcmd"], "error: No such command 'nosuchcmd' (`ogrpo -h` for help)"),
])
def test_usage_errors_are_one_line_with_where_to_find_help(run_cli, args, words):
    """The command line's own mistakes (an unknown option, a value of the wrong type, a missing argument) get the
    one line every other bad input gets, not click's usage block."""
    proc = run_cli(*args)
    assert proc.returncode == 2 and proc.stderr.strip() == words, proc.stderr


def test_a_file_in_the_way_of_the_job_is_named(run_cli, tmp_path):
    """A file where the job's logs/ folder goes: the one line names it, and what was in -o is left as it was."""
    out = tmp_path / "job"
    out.mkdir()
    (out / "logs").write_text("mine\n")
    proc = run_cli("render", "--gpus", "cpu", "--config", "tiny", "-o", out)
    errors = [x for x in proc.stderr.splitlines() if not x.startswith("change: ")]  # the plan's listed changes
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert f"cannot write the job there ({out / 'logs'}: File exists)" in errors[0]
    assert sorted(p.name for p in out.iterdir()) == ["logs"] and (out / "logs").read_text() == "mine\n"


def test_a_problem_of_the_default_rewards_says_they_are_the_default(run_cli, write_recipe):
    """reward_funcs left out: open-r1's default rewards apply, and a dataset that lacks what they read is refused
    with a line that says the rewards were not the user's choice (it named a reward they never wrote)."""
    recipe = write_recipe("model_name_or_path: ogrpo:tiny\ndataset_name: ogrpo:tiny\nreward_funcs:\n"
                          "max_completion_length: 32\n")
    proc = run_cli("plan", "--gpus", "cpu", "--config", recipe)
    errors = [x for x in proc.stderr.splitlines() if not x.startswith("change: ")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert "needed by reward accuracy (reward_funcs is not set: open-r1's default ['accuracy'" in errors[0]


def test_a_command_line_option_over_the_recipes_value_is_listed_and_strict_lets_it_through(run_cli, write_recipe):
    """--gpus over the recipe's ogrpo.gpus: the plan is made for --gpus and says what it replaced; --strict refuses
    the changes nobody asked for, not this one."""
    recipe = write_recipe("model_name_or_path: ogrpo:tiny\ndataset_name: ogrpo:tiny\nreward_funcs: [tiny_letter]\n"
                          "max_completion_length: 32\nuse_vllm: false\nogrpo:\n  gpus: 2xV100\n  profile: aggressive\n")
    proc = run_cli("plan", "--gpus", "cpu", "--profile", "balanced", "--config", recipe)
    assert proc.returncode == 0, proc.stderr
    assert "change: ogrpo.gpus: '2xV100' -> 'cpu' (--gpus on the command line)" in proc.stderr
    assert "change: ogrpo.profile: 'aggressive' -> 'balanced' (--profile on the command line)" in proc.stderr
    strict = run_cli("plan", "--gpus", "cpu", "--profile", "balanced", "--config", recipe, "--strict")
    assert "ogrpo.gpus would change" not in strict.stderr and "ogrpo.profile would change" not in strict.stderr
    same = run_cli("plan", "--gpus", "2xV100", "--config", recipe)
    assert "change: ogrpo.gpus" not in same.stderr  # the same value is no change


@pytest.mark.parametrize("command, words", [("status", "JOB is empty"), ("logs", "JOB is empty"),
                                            ("cancel", "JOB is empty"), ("reproduce", "RUN is empty")])
def test_an_empty_job_is_refused_not_taken_as_the_current_directory(run_cli, tmp_path, command, words):
    proc = run_cli(command, "", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().startswith(f"error: {words}"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_selftest_keeps_an_earlier_report(run_cli, tmp_path):
    """A report path that holds a file (an earlier report) is refused before the checks, the file kept."""
    earlier = tmp_path / "report.json"
    earlier.write_text('{"earlier": true}')
    proc = run_cli("selftest", "--no-server", "-o", earlier, cwd=tmp_path)
    assert proc.returncode == 2 and "a file is there already" in proc.stderr, proc.stderr[-2000:]
    assert earlier.read_text() == '{"earlier": true}'


@pytest.mark.parametrize("record", ["[1, 2]", "{}", '{"state": "RUNNING"}', '{"state": "RUNNING", "pid": "12"}'])
def test_a_local_record_of_another_shape_is_one_line_for_status_and_cancel(run_cli, tmp_path, record):
    """local/state.json that is JSON but no run record (hand-edited, another tool's): one line, no traceback."""
    job = tmp_path / "job"
    (job / "local").mkdir(parents=True)
    (job / "job.sbatch").write_text("#!/bin/bash\n")
    (job / "local" / "state.json").write_text(record)
    for command in ("status", "cancel"):
        proc = run_cli(command, job, cwd=tmp_path)
        assert proc.returncode == 2 and "no readable local/state.json" in proc.stderr, proc.stderr[-2000:]
        _no_traceback(proc)
