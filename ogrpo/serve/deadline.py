"""Every request the trainer's VLLMClient makes is bounded, and fails fast once the job is stopping.

TRL's client posts with no timeout: a server that stops answering (vLLM on SIGTERM waits in "Waiting for
connections to close" while its engine is gone) holds the trainer in a POST forever, and a preemption's SIGKILL
or the allocation's end is all that ends it. Here (through the job-key session every client uses,
ogrpo.serve.auth):
- every request gets a connect timeout and a read timeout (`OGRPO_REQUEST_TIMEOUT_S`, long enough for the
  largest generation a plan makes; a request that set its own keeps it);
- once this process is stopping (`stopping`, set by the trainer's SIGTERM handler, ogrpo.trainer.preemption), a
  request in flight fails within seconds when the server no longer answers `/health`, and with it the step:
  the trainer then leaves for requeue with its last complete checkpoint instead of waiting for a server that
  got the same SIGTERM. While the server still answers, the request is waited for as usual.

Imports nothing heavy: the server process imports the session module too.
"""

from __future__ import annotations

import os
import threading

TIMEOUT_ENV = "OGRPO_REQUEST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 1800.0  # a generation of the largest batch a plan makes, on the slowest planned GPU
CONNECT_TIMEOUT_S = 30.0
POLL_S = 0.5  # how often a waiting request looks at the stop flag
PROBE_TIMEOUT_S = 2.0

stopping = threading.Event()  # this process was told to stop (SIGTERM): its server may be going away too


class ServerGone(ConnectionError):
    """The job is stopping and the server stopped answering while a request was in flight."""


def read_timeout_s() -> float:
    try:
        return float(os.environ.get(TIMEOUT_ENV) or DEFAULT_TIMEOUT_S)
    except ValueError:
        return DEFAULT_TIMEOUT_S


def bounded(kwargs: dict) -> dict:
    """requests keywords with a (connect, read) timeout unless the caller set one."""
    if kwargs.get("timeout") is None:
        kwargs["timeout"] = (CONNECT_TIMEOUT_S, read_timeout_s())
    return kwargs


def _answers(health_url: str) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(health_url, timeout=PROBE_TIMEOUT_S) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def call(send, health_url: str | None, what: str):
    """`send()` (a blocking request), given up when the job is stopping and `health_url` no longer answers.
    The request runs on a daemon thread so that the caller can stop waiting for it; it ends by its own timeout."""
    if health_url is None:
        return send()
    box: dict = {}
    done = threading.Event()

    def run():
        try:
            box["value"] = send()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller as is
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name="ogrpo-request", daemon=True).start()
    while not done.wait(POLL_S):
        if stopping.is_set() and health_url is not None and not _answers(health_url):
            raise ServerGone(f"{what}: the job is stopping and the server at {health_url.rsplit('/', 1)[0]} "
                             "no longer answers")
    if "error" in box:
        raise box["error"]
    return box["value"]
