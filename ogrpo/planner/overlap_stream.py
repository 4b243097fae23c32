"""How `ogrpo.overlap: lossless` takes a batch from the server: group by group, or whole (the plan's
`overlap.stream` setting, with its reason).

Group by group (ogrpo.patches.trl_overlap, ogrpo.serve.client.group_calls): one request per prompt group, each
finished group's rewards and log-prob passes running while the server generates the rest. That needs a server that
batches concurrent requests and a trainer whose one process holds every group. Elsewhere the batch comes back
whole and only the rewards run beside its log-prob passes; the samples, losses and updates are the same either
way, only the waiting differs. The trainer decides the same way at run time (its own TRL and process count), and
also takes a batch whole where per-group passes would not give TRL's numbers (dropout, images, a reward model).
"""

from __future__ import annotations

GROUPS, BATCH = "groups", "batch"
# The first TRL line whose VLLMClient speaks to vLLM's OpenAI API server (ogrpo.compat.server_flavor), which
# batches concurrent requests; tests/test_overlap.py checks the two agree.
FIRST_STREAMING_LINE = (1, 16)


def decide(trl_version: str, trainer_processes: int) -> tuple[str, str]:
    """(GROUPS or BATCH, why) for a lossless run under `trl_version` with this many trainer processes."""
    from ogrpo.stacks import parse_version

    if parse_version(trl_version)[:2] < FIRST_STREAMING_LINE:
        return BATCH, (f"TRL {trl_version}'s server (`trl vllm-serve`) answers one request at a time (each a "
                       "blocking LLM.generate): per-group requests would be generated one after another in small "
                       "batches, so each batch is requested whole and the rewards run beside its log-prob passes")
    if trainer_processes > 1:
        return BATCH, (f"{trainer_processes} trainer processes: the main process generates every rank's groups "
                       "while the others wait in its broadcast, and each rank scores only its own share in "
                       "forward passes that must run in step on every rank (collectives under ZeRO-3); each batch "
                       "comes back whole and the rewards run beside its log-prob passes")
    return GROUPS, ("one request per prompt group (each with the seeds it has inside the one request): a finished "
                    "group's rewards and reference/old-policy log-probs are computed while the server generates "
                    "the rest")


def trl_version(rules) -> str:
    """The TRL the plan's trainer runs under: the installed one where the plan runs where it is made (CPU),
    else the images' line (the same rule as ogrpo.compat.plan_trl_version, which sits above the planner)."""
    if rules.runs_locally:
        from importlib import metadata

        try:
            return metadata.version("trl")
        except metadata.PackageNotFoundError:
            pass
    return rules.trl_line
