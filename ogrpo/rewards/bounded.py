"""A persistent pool of worker processes that applies one function to a batch of items, each item under a hard
time limit: the worker of an item that overruns is SIGKILLed (with its process group) and replaced.

Why processes: math-verify bounds its own parsing and verification with signal.alarm, which only the main
thread may set, and which cannot interrupt C code (a huge integer power) in any case; TRL can call reward
functions from a worker thread, where a `\\frac` nested 10,000 deep ran for minutes. A thread cannot be
stopped from outside; a process can.

Why this shape:
- Workers are fresh interpreters started with subprocess.Popen (fork+exec in C, as spawn does), never a fork
  of the trainer: no CUDA context, NCCL state or held lock is copied. They stay up across calls, so a reward
  call costs one pipe round trip per worker (items go out as one JSON line, results come back one line per
  item as it finishes), not an interpreter start-up and a sympy import per call.
- Only JSON crosses the pipes, never pickle: a worker handles model-written text, and nothing it sends back
  can make the trainer run code.
- Each item's clock starts when its worker reaches it (after the batch is written, or the previous result
  arrived), so one slow item never eats the budget of those queued behind it. The items of a replaced worker
  go to its replacement; a worker that cannot start (its function does not import) is an error, not a score.
- A worker exits when the trainer dies (it watches its parent pid), so nothing outlives the run; `close` kills
  and reaps them all, and runs at interpreter exit.

Worker side: `python -m ogrpo.rewards.bounded MODULE:FUNCTION PARENT_PID [MODULE:INIT]`.
"""

from __future__ import annotations

import json
import os
import sys

from ogrpo.errors import OgrpoError


class _Marker:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


TIMED_OUT = _Marker("TIMED_OUT")  # the item ran past its time limit; its worker was killed
FAILED = _Marker("FAILED")  # the function raised, or the worker died on the item


def _import(target: str):
    import importlib

    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


# ========================================= worker (a fresh interpreter) ========================================


def _watch_parent(parent: int) -> None:
    """Exit when the trainer is gone (reparented), even in the middle of an item."""
    import threading
    import time

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="ogrpo-parent-watch", daemon=True).start()


def _worker_main(target: str, parent: int, init: str | None) -> int:
    proto = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # stray prints of the function go to stderr, never into the protocol

    def send(obj) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    if os.getppid() != parent:
        return 0
    _watch_parent(parent)
    try:
        if init:
            _import(init)()
        func = _import(target)
    except BaseException as exc:  # noqa: BLE001 - reported to the trainer as a one-line error
        send({"error": f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"})
        return 1
    send({"ready": os.getpid()})
    for line in sys.stdin.buffer:
        for index, arg in json.loads(line):
            try:
                reply = [index, func(arg)]
                text = json.dumps(reply)
            except Exception as exc:  # noqa: BLE001 - one bad item must not take the worker down
                text = json.dumps([index, None, f"{type(exc).__name__}: {exc}"[:500]])
            proto.write(text + "\n")
            proto.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None))

# ============================================== trainer side ==================================================

import atexit  # noqa: E402
import select  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import weakref  # noqa: E402

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Worker:
    def __init__(self, target: str, init: str | None, env: dict[str, str]):
        argv = [sys.executable, "-m", "ogrpo.rewards.bounded", target, str(os.getpid())] + ([init] if init else [])
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True,
                                     start_new_session=True, env=env)
        self.pid = self.proc.pid
        self.rfd, self.wfd = self.proc.stdout.fileno(), self.proc.stdin.fileno()
        os.set_blocking(self.wfd, False)
        self.started = time.monotonic()
        self.ready = False
        self.buf = b""
        self.out = b""  # bytes of the batch not yet written
        self.queue: list[tuple[int, object]] = []  # items sent, in the order the worker runs them
        self.deadline = 0.0

    def kill(self) -> None:
        """SIGKILL the worker's process group and reap the worker."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        self.proc.wait()


class BoundedPool:
    """`map(items)` applies `target` ("module:function", one JSON value in, one out) in worker processes.

    An item whose call runs past `timeout_s` gives `on_timeout` (default TIMED_OUT) and its worker is killed
    and replaced; a call that raises, or kills its worker, gives `on_error` (default FAILED). `init`
    ("module:function", no arguments) runs once per worker before it takes items (imports, warm-up), so that
    cost never counts against an item. Safe to call from any thread; calls are serialised.
    """

    def __init__(self, target: str, workers: int = 1, timeout_s: float = 10.0, init: str | None = None,
                 start_timeout_s: float = 120.0):
        self.target, self.init = target, init
        self.workers = max(1, int(workers))
        self.timeout_s, self.start_timeout_s = float(timeout_s), float(start_timeout_s)
        self.timeouts = 0  # items killed for overrunning, over the pool's life
        self._item_timeout = self.timeout_s
        self._pool: list[_Worker] = []
        self._lock = threading.Lock()
        self._owner = os.getpid()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO, env.get("PYTHONPATH", "")) if p)
        self._env = env
        atexit.register(_close_ref, weakref.ref(self))

    # --- public API ------------------------------------------------------------------------------------------
    def map(self, items: list, timeout_s: float | None = None, on_timeout=TIMED_OUT, on_error=FAILED) -> list:
        with self._lock:
            if os.getpid() != self._owner:  # a forked child must not share the parent's pipes
                self._pool, self._owner = [], os.getpid()
            self._item_timeout = self.timeout_s if timeout_s is None else float(timeout_s)
            try:
                return self._map(list(items), on_timeout, on_error)
            except BaseException:
                # Workers may still be busy with this batch and would answer the next one with stale results.
                for w in self._pool:
                    w.kill()
                self._pool = []
                raise

    def pids(self) -> list[int]:
        """The worker processes now running (for tests and diagnostics)."""
        return [w.pid for w in self._pool if w.proc.poll() is None]

    def close(self) -> None:
        with self._lock:
            if os.getpid() == self._owner:
                for w in self._pool:
                    w.kill()
            self._pool = []

    def __enter__(self) -> "BoundedPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- internals -------------------------------------------------------------------------------------------
    def _spawn(self) -> _Worker:
        return _Worker(self.target, self.init, self._env)

    def _map(self, items: list, on_timeout, on_error) -> list:
        n = len(items)
        results: list = [None] * n
        if n == 0:
            return results
        for w in [w for w in self._pool if w.proc.poll() is not None]:  # died while idle (OOM killer, ...)
            w.kill()
            self._pool.remove(w)
        while len(self._pool) < min(self.workers, n):
            self._pool.append(self._spawn())
        active = self._pool[:min(self.workers, n)]
        for k, w in enumerate(active):  # interleaved shares: neighbouring items often cost alike
            w.queue = [(i, items[i]) for i in range(k, n, len(active))]
            w.out, w.buf = b"", b""
            if w.ready:
                self._send(w)
        remaining = n
        while remaining:
            now = time.monotonic()
            for idx, w in enumerate(active):
                if not w.queue:
                    continue
                limit = w.deadline if w.ready else w.started + self.start_timeout_s
                if now < limit:
                    continue
                if not w.ready:
                    w.kill()

                    raise OgrpoError(f"{self.target} worker did not start within {self.start_timeout_s:.0f} s")
                i, _ = w.queue.pop(0)  # the item it was running
                results[i] = on_timeout
                remaining -= 1
                self.timeouts += 1
                active[idx] = self._replace(w)
            remaining -= self._poll(active, results, on_error)
        return results

    def _replace(self, dead: _Worker) -> _Worker:
        dead.kill()
        fresh = self._spawn()
        fresh.queue = dead.queue
        self._pool[self._pool.index(dead)] = fresh
        return fresh

    def _send(self, w: _Worker) -> None:
        w.out = (json.dumps([[i, arg] for i, arg in w.queue]) + "\n").encode()
        w.deadline = time.monotonic() + self._item_timeout
        self._flush(w)

    def _flush(self, w: _Worker) -> None:
        try:
            written = os.write(w.wfd, w.out)
        except BlockingIOError:
            return
        except (BrokenPipeError, OSError):
            w.out = b""  # the worker died; its EOF on stdout is handled by the reader
            return
        w.out = w.out[written:]

    def _poll(self, active: list[_Worker], results: list, on_error) -> int:
        """Wait for output (or room to write) until the nearest deadline; returns how many items finished."""
        poller = select.poll()
        by_fd = {}
        nearest = time.monotonic() + 1.0
        for w in active:
            if not w.queue:
                continue
            by_fd[w.rfd] = w
            poller.register(w.rfd, select.POLLIN)
            if w.out:
                by_fd[w.wfd] = w
                poller.register(w.wfd, select.POLLOUT)
            nearest = min(nearest, w.deadline if w.ready else w.started + self.start_timeout_s)
        finished = 0
        for fd, _ in poller.poll(max(0.0, nearest - time.monotonic()) * 1000):
            w = by_fd[fd]
            if w not in active:  # replaced earlier in this round; its fd number may now be the replacement's
                continue
            if fd == w.wfd:
                self._flush(w)
                continue
            try:
                chunk = os.read(w.rfd, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:  # the worker died
                finished += self._died(w, active, results, on_error)
                continue
            w.buf += chunk
            *lines, w.buf = w.buf.split(b"\n")
            for line in lines:
                try:
                    msg = json.loads(line)
                except ValueError:  # not our protocol: treat the worker as broken
                    finished += self._died(w, active, results, on_error)
                    break
                finished += self._message(w, msg, results, on_error)
        return finished

    def _message(self, w: _Worker, msg, results: list, on_error) -> int:
        if isinstance(msg, dict):
            if "error" in msg:
                w.kill()
                raise OgrpoError(f"{self.target} worker cannot start: {msg['error']}")
            w.ready = True
            if w.queue:
                self._send(w)
            return 0
        i = msg[0]
        if not w.queue or w.queue[0][0] != i:
            return 0  # a reply to an earlier, abandoned batch (cannot happen: a killed worker is replaced)
        w.queue.pop(0)
        results[i] = msg[1] if len(msg) == 2 else on_error
        w.deadline = time.monotonic() + self._item_timeout
        return 1

    def _died(self, w: _Worker, active: list[_Worker], results: list, on_error) -> int:
        if not w.ready:
            w.kill()
            code = w.proc.returncode
            raise OgrpoError(f"{self.target} worker exited {code} while starting (see its stderr above)")
        i, _ = w.queue.pop(0)  # the item it was running killed it (memory, a crash in C)
        results[i] = on_error
        active[active.index(w)] = self._replace(w)
        return 1


def _close_ref(ref) -> None:
    pool = ref()
    if pool is not None:
        pool.close()
