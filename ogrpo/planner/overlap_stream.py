"""How `ogrpo.overlap: lossless` takes a batch from the server: group by group, or whole (the plan's
`overlap.stream` setting, with its reason).

Group by group (ogrpo.overlap.streaming, ogrpo.serve.client.group_calls): one request per prompt group, each
finished group's rewards and log-prob passes running while the server generates the rest. With several trainer
processes the main process hands each finished group to every rank as it arrives and the rank that owns it works
on it; where the log-prob passes are collectives (ZeRO-3) the ranks run their k-th passes together. That needs a
server that batches concurrent requests (vLLM's API server; `trl vllm-serve` for TRL 1.9's client with one engine,
through ogrpo.serve.trl_stream) and groups that each sit whole on one rank. Elsewhere the batch comes
back whole and only the rewards run beside its log-prob passes; the samples, losses and updates are the same
either way, only the waiting differs. The trainer reads this decision from the plan (ogrpo.trainer.assembly.install_overlap)
and still takes a batch whole where per-group passes would not give TRL's numbers (dropout, images, a reward
model): what only the built trainer shows.
"""

from __future__ import annotations

from ogrpo.planner.types import OverlapStream
from ogrpo.stacks import parse_version

GROUPS, BATCH = OverlapStream.GROUPS.value, OverlapStream.BATCH.value
# The first TRL line whose VLLMClient speaks to vLLM's OpenAI API server (ogrpo.compat.server_flavor); earlier
# lines talk to `trl vllm-serve`. tests/test_overlap.py checks the two agree.
FIRST_VLLM_API_LINE = (1, 16)


def decide(trl_version: str, trainer_processes: int, rank_rows: int | None = None,
           num_generations: int | None = None, server_dp: int = 1) -> tuple[str, str]:
    """(GROUPS or BATCH, why) for a lossless run under `trl_version` with this many trainer processes, each
    scoring `rank_rows` completions per generation in groups of `num_generations`, against a server of
    `server_dp` data-parallel engines."""

    trl_serve = parse_version(trl_version)[:2] < FIRST_VLLM_API_LINE
    if trl_serve and server_dp > 1:
        return BATCH, (f"TRL {trl_version}'s server (`trl vllm-serve`) with {server_dp} data-parallel engines "
                       "answers one request at a time (each a blocking LLM.generate over the engines; O-GRPO "
                       "batches concurrent requests for one engine only): per-group requests would be generated "
                       "one after another, so each batch is requested whole and the rewards run beside its "
                       "log-prob passes")
    if trainer_processes > 1 and rank_rows and num_generations and rank_rows % num_generations:
        return BATCH, (f"{trainer_processes} trainer processes with {rank_rows} completions each per generation, "
                       f"not whole groups of {num_generations}: a group would be split between ranks, so each "
                       "batch comes back whole and the rewards run beside its log-prob passes")
    why = ("one request per prompt group (each with the seeds it has inside the one request): a finished group's "
           "rewards and reference/old-policy log-probs are computed while the server generates the rest")
    if trl_serve:
        why += (f" (TRL {trl_version}'s `trl vllm-serve`, whose /generate/ answers one request at a time, runs "
                "with O-GRPO's handler: concurrent requests join one engine batch and each is answered when done)")
    if not trl_serve and trainer_processes == 1:
        why += ("; each completion is its own request (with the seed it has inside its group's): its passes, and "
                "its loss forward where groups train ahead, run as it ends (the trainer's manifest says "
                "overlap.stream_unit), its reference/old-policy passes on its tokens so far while it generates "
                "(streamed every few tokens), so only its last tokens wait for its end (overlap.prefix_passes), "
                "and so does its loss forward where no gradient checkpointing recomputes it "
                "(overlap.prefix_forwards)")
    if trainer_processes > 1:
        why += (f"; the main process hands each finished group to the one of the {trainer_processes} trainer "
                "processes that owns it (the ranks run their k-th log-prob passes together where those are "
                "collectives, as under ZeRO-3)")
    return GROUPS, why


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
