"""Signals that end a command which started other processes: its `finally` blocks must still run.

Python's default for SIGTERM and SIGHUP is to die on the spot, skipping every `finally`, so a vLLM server
started in its own session (so that it can be stopped as a group) outlives the command that started it.
SIGINT already arrives as KeyboardInterrupt.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


@contextmanager
def exit_on_signals(signals=SIGNALS):
    """Within the block, SIGTERM/SIGHUP raise SystemExit(128 + signal), so cleanup in `finally` runs."""
    if threading.current_thread() is not threading.main_thread():  # handlers can only be set there
        yield
        return
    old = {sig: signal.signal(sig, _raise_exit) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
