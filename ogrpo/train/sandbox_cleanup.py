"""Removal of the sandbox's host-side work directories: iterative, complete, and off the trainer's path.

A program that ran in a directory (the "none" level; compile runs at every level) can leave a tree built to
defeat `shutil.rmtree`: thousands of nested directories (its recursion raised RecursionError, and their paths
outgrow PATH_MAX), a mode-000 directory holding a symlink (a non-root rmtree cannot list it, and Python's
chmod(follow_symlinks=False) raises NotImplementedError on Linux), or hundreds of thousands of small files
(seconds of unlink calls). `remove_tree` walks with one directory fd at a time, relative to its parent (no path
length, no recursion, no fd per level), makes every directory it meets searchable and writable by its owner,
never follows a symlink, and skips what it cannot remove instead of raising. The `Cleaner` thread runs it, so
a reward call only hands the directory over.

At the namespace levels the program itself runs on a size-capped tmpfs that dies with its mount namespace; what
reaches this module there is the trainer's source file, the compiler's output and the stdio files.
"""

from __future__ import annotations

import atexit
import os
import stat
import sys
import threading

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _entries(fd: int, stuck: set) -> tuple[list[str], str | None, bool]:
    """(non-directories, first subdirectory not known to be stuck, whether a stuck one was seen) of the
    directory open at fd."""
    files, sub, blocked = [], None, False
    with os.scandir(fd) as it:
        for e in it:
            try:
                if not e.is_dir(follow_symlinks=False):
                    files.append(e.name)
                elif (e.stat(follow_symlinks=False).st_dev, e.inode()) in stuck:
                    blocked = True
                elif sub is None:
                    sub = e.name
            except OSError:
                continue
    return files, sub, blocked


def _open_dir(name: str, parent: int) -> int:
    st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(name)
    if st.st_mode & 0o700 != 0o700:  # a mode-000 dir (or one without w/x): its owner may restore them
        os.chmod(name, stat.S_IMODE(st.st_mode) | 0o700, dir_fd=parent)  # it is a directory: no link followed
    return os.open(name, _DIR_FLAGS, dir_fd=parent)


def remove_tree(path: str) -> list[str]:
    """Remove `path` and everything below it; returns what could not be removed (empty when all went)."""
    path = os.path.abspath(path)
    left: list[str] = []
    stuck: set = set()  # (dev, ino) of directories that cannot be emptied: never entered again
    try:
        fd = os.open(os.path.dirname(path) or "/", _DIR_FLAGS)
    except OSError as exc:
        return [f"{path}: {exc.strerror}"]
    names: list[str] = []  # the directories entered below dirname(path), outermost first
    pending: str | None = os.path.basename(path)  # an entry of the directory at fd to remove next

    def where(name: str) -> str:
        return os.path.join(os.path.dirname(path), *names, name)

    try:
        while True:
            if pending is not None:
                name, pending = pending, None
                key = None
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    key = (st.st_dev, st.st_ino)
                    if not stat.S_ISDIR(st.st_mode):
                        os.unlink(name, dir_fd=fd)
                    else:
                        try:
                            os.rmdir(name, dir_fd=fd)
                        except OSError:
                            if key in stuck:
                                raise
                            child = _open_dir(name, fd)
                            os.close(fd)
                            fd = child
                            names.append(name)
                            continue
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    if key is not None:
                        stuck.add(key)
                    left.append(f"{where(name)}: {exc.strerror or exc}")
                if not names:
                    return left
            # in the directory at fd: unlink its files; enter its first subdirectory, else go up and remove it
            files, sub, blocked = _entries(fd, stuck)
            for f in files:
                try:
                    os.unlink(f, dir_fd=fd)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    blocked = True
                    left.append(f"{os.path.join(where(''), f)}: {exc.strerror}")
            if sub is not None:
                pending = sub
                continue
            if blocked:
                st = os.fstat(fd)
                stuck.add((st.st_dev, st.st_ino))
            parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = parent
            pending = names.pop()
    except OSError as exc:  # the walk itself failed (the tree moved under us): report, never raise
        left.append(f"{path}: {exc.strerror or exc}")
        return left
    finally:
        try:
            os.close(fd)
        except OSError:
            pass


class Cleaner:
    """One background thread removing work directories in order. `drain()` waits until all are gone."""

    def __init__(self):
        self._cond = threading.Condition()
        self._queue: list[str] = []
        self._busy = False
        self._thread: threading.Thread | None = None
        self.failures: list[str] = []  # what could not be removed (logged once per directory)
        self.removed_by: set[int] = set()  # thread idents that removed directories (tests check it is not theirs)

    def submit(self, path: str) -> None:
        with self._cond:
            self._queue.append(path)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="ogrpo-sandbox-cleaner", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """True when nothing is queued or being removed (within `timeout` seconds)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._cond.wait_for(lambda: self._queue, timeout=30.0):
                    self._thread = None  # idle: a later submit starts a new thread
                    return
                path = self._queue.pop(0)
                self._busy = True
            try:
                left = remove_tree(path)
            except BaseException as exc:  # noqa: BLE001 - the cleaner must outlive anything a tree does
                left = [f"{path}: {type(exc).__name__}: {exc}"]
            self.removed_by.add(threading.get_ident())
            if left:
                self.failures.extend(left)
                print(f"warning: sandbox cleanup left {len(left)} entries, first: {left[0]}", file=sys.stderr)
            with self._cond:
                self._busy = False
                self._cond.notify_all()


CLEANER = Cleaner()
# At interpreter exit, whatever is queued is still removed (the thread is a daemon, so exit would not wait).
atexit.register(CLEANER.drain)
