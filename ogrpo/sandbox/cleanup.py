"""Removal of the sandbox's host-side work directories: iterative, complete, confined to its root, and off the
trainer's path.

A program that ran in a directory (the "none" level; compile runs at every level) can leave a tree built to
defeat `shutil.rmtree`: thousands of nested directories (its recursion raised RecursionError, and their paths
outgrow PATH_MAX), a mode-000 directory holding a symlink (a non-root rmtree cannot list it, and Python's
chmod(follow_symlinks=False) raises NotImplementedError on Linux), or hundreds of thousands of small files
(seconds of unlink calls). A tree may also change while it is removed (a rename moving a directory the walk is
in): a walk that climbs back with `..` then continues in whatever directory that now is, up to `/`.

`remove_tree` therefore never names a directory it has not verified:
- it descends with openat(O_NOFOLLOW | O_DIRECTORY) relative to a directory fd it holds, and checks that the
  opened directory is the (st_dev, st_ino) it listed a moment before (a swap in between is refused, not
  followed); it returns to a parent through the fd it holds for it (a bounded window of fds; shallower levels
  are re-opened from the nearest held ancestor by name, each step checked the same way), never through `..`;
- it never enters another mount (device or mount id differ) and never follows a symlink: entries are removed
  with unlinkat/rmdir relative to the held fd, and the one metadata change it makes (a non-root cleaner giving
  its own mode-000 directory back u+rwx) goes to the inode of a verified fd (/proc/self/fd), never by name. A
  root cleaner changes no mode at all: it needs none to read or remove;
- when a check fails (the tree moved under it) it starts again from the root fd, at most a few times, and
  reports what it left.
Everything it removes lies in a directory it reached from the root by verified steps, so even a concurrent
writer cannot turn it against a file outside the tree. The `Cleaner` thread runs it, so a reward call only hands
the directory over; `submit(path, done)` calls `done` once the tree is gone (the sandbox frees the slot then).

At the namespace levels the program itself runs on a size-capped tmpfs that dies with its mount namespace; what
reaches this module there is the trainer's source file and the compiler's output.
"""

from __future__ import annotations

import atexit
import os
import stat
import sys
import threading

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_PATH_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_FDS = 64  # directory fds held at once (the deepest levels); shallower ones are re-opened when needed
_RESTARTS = 3


class _Moved(Exception):
    """A directory is not what the walk verified a moment before: the tree changed under it."""


class _OtherMount(Exception):
    """A directory on another mount: never entered (a mount point inside the tree is left as it is)."""


def _mount_id(fd: int) -> int | None:
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
            for line in f:
                if line.startswith(b"mnt_id:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _entries(fd: int, stuck: set) -> tuple[list[str], list[tuple[str, tuple[int, int]]], bool]:
    """(non-directories, subdirectories not known to be stuck with their (dev, ino), whether a stuck one was
    seen) of the directory open at fd."""
    files, subs, blocked = [], [], False
    with os.scandir(fd) as it:
        for e in it:
            try:
                if not e.is_dir(follow_symlinks=False):
                    files.append(e.name)
                    continue
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            key = (st.st_dev, st.st_ino)
            if key in stuck:
                blocked = True
            else:
                subs.append((e.name, key))
    return files, subs, blocked


class _Walk:
    """One removal: a stack of levels (name, (dev, ino), fd or -1), the root at index 0, always held."""

    def __init__(self, path: str, root_key: tuple[int, int], max_fds: int):
        self.path, self.max_fds, self.euid = path, max(2, max_fds), os.geteuid()
        self.root_key, self.root_mnt = root_key, None
        self.names, self.keys, self.fds = [""], [root_key], [-1]
        self.left: list[str] = []
        self.stuck: set = set()  # (dev, ino) of directories that cannot be emptied: never entered again
        self.failed: set = set()  # ((dev, ino) of a directory, name) of entries that could not be removed

    def where(self, name: str = "") -> str:
        return os.path.join(self.path, *self.names[1:], name)

    def open_child(self, parent_fd: int, name: str, key: tuple[int, int]) -> int:
        """The directory `name` of parent_fd, verified to be `key` and on the root's mount."""
        if key[0] != self.root_key[0]:
            raise _OtherMount(name)
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        except PermissionError:
            if self.euid == 0:
                raise
            fd = self._open_restoring_mode(parent_fd, name, key)
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != key:
                raise _Moved(name)
            if self.root_mnt is not None and _mount_id(fd) != self.root_mnt:  # a bind mount of the same fs
                raise _OtherMount(name)
            if self.euid != 0 and st.st_uid == self.euid and st.st_mode & 0o700 != 0o700:
                os.fchmod(fd, stat.S_IMODE(st.st_mode) | 0o700)  # unlinking in it needs w and x
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _open_restoring_mode(self, parent_fd: int, name: str, key: tuple[int, int]) -> int:
        """A directory of ours that we may not read (mode 000): u+rwx on the inode an O_PATH fd verified, then
        re-opened through that fd (no name is looked up twice)."""
        pfd = os.open(name, _PATH_FLAGS, dir_fd=parent_fd)
        try:
            st = os.fstat(pfd)
            if (st.st_dev, st.st_ino) != key:
                raise _Moved(name)
            if st.st_uid != self.euid:
                raise PermissionError(13, "not the cleaner's directory")
            os.chmod(f"/proc/self/fd/{pfd}", stat.S_IMODE(st.st_mode) | 0o700)  # the fd's own inode
            return os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        finally:
            os.close(pfd)

    def fd_at(self, i: int) -> int:
        """The fd of level i; re-opened step by step from the nearest held ancestor when it was let go."""
        if self.fds[i] >= 0:
            return self.fds[i]
        j = i
        while self.fds[j] < 0:
            j -= 1
        for k in range(j + 1, i + 1):
            self.fds[k] = self.open_child(self.fds[k - 1], self.names[k], self.keys[k])
            if 0 < k - 1 <= i - self.max_fds:
                os.close(self.fds[k - 1])
                self.fds[k - 1] = -1
        return self.fds[i]

    def push(self, name: str, key: tuple[int, int], fd: int) -> None:
        self.names.append(name)
        self.keys.append(key)
        self.fds.append(fd)
        old = len(self.fds) - 1 - self.max_fds
        if old >= 1 and self.fds[old] >= 0:
            os.close(self.fds[old])
            self.fds[old] = -1

    def pop(self) -> None:
        fd = self.fds.pop()
        self.names.pop()
        self.keys.pop()
        if fd >= 0:
            os.close(fd)

    def restart(self) -> None:
        while len(self.fds) > 1:
            self.pop()

    def run(self) -> None:
        restarts = 0
        while True:
            try:
                self._walk()
                return
            except _Moved as exc:
                self.restart()
                restarts += 1
                if restarts > _RESTARTS:
                    self.left.append(f"{self.path}: the tree kept changing during removal ({exc}); left as is")
                    return

    def _walk(self) -> None:
        while True:
            i = len(self.fds) - 1
            fd = self.fd_at(i)
            here = self.keys[i]
            files, subs, blocked = _entries(fd, self.stuck)
            for f in files:
                if (here, f) in self.failed:
                    blocked = True
                    continue
                try:
                    os.unlink(f, dir_fd=fd)  # unlinkat: the entry itself, a symlink included, never its target
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    blocked = True
                    self.failed.add((here, f))
                    self.left.append(f"{self.where(f)}: {exc.strerror}")
            entered = False
            for name, key in subs:
                try:
                    os.rmdir(name, dir_fd=fd)
                    continue
                except FileNotFoundError:
                    continue
                except OSError:
                    pass
                try:
                    child = self.open_child(fd, name, key)
                except FileNotFoundError:
                    continue
                except (OSError, _OtherMount) as exc:
                    self.stuck.add(key)
                    blocked = True
                    why = "another mount, not entered" if isinstance(exc, _OtherMount) else exc.strerror
                    self.left.append(f"{self.where(name)}: {why}")
                    continue
                self.push(name, key, child)
                entered = True
                break
            if entered:
                continue
            if i == 0:
                return
            name = self.names[i]
            self.pop()
            if blocked:  # its parent's listing now skips it, and is blocked in turn
                self.stuck.add(here)
                continue
            pfd = self.fd_at(i - 1)
            try:
                st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                if (st.st_dev, st.st_ino) != here:
                    raise _Moved(name)
                os.rmdir(name, dir_fd=pfd)
            except FileNotFoundError:
                raise _Moved(name) from None
            except OSError as exc:
                self.stuck.add(here)
                self.left.append(f"{self.where(name)}: {exc.strerror}")


def remove_tree(path: str, max_fds: int = MAX_FDS) -> list[str]:
    """Remove `path` and everything below it that lies on its mount; returns what could not be removed (empty
    when all went). Never touches anything outside `path` (see the module docstring)."""
    path = os.path.abspath(path)
    parent_path, name = os.path.split(path)
    try:  # the caller's path to the root's parent may hold symlinks (a TMPDIR that is one): followed
        pfd = os.open(parent_path or "/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        return [f"{path}: {exc.strerror}"]
    walk = None
    try:
        st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        key = (st.st_dev, st.st_ino)
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=pfd)
            return []
        try:
            os.rmdir(name, dir_fd=pfd)
            return []
        except OSError:
            pass
        walk = _Walk(path, key, max_fds)
        walk.fds[0] = walk.open_child(pfd, name, key)
        walk.root_mnt = _mount_id(walk.fds[0])
        walk.run()
        if not walk.left:
            os.rmdir(name, dir_fd=pfd)
        return walk.left
    except FileNotFoundError:
        return walk.left if walk else []
    except (OSError, _Moved, _OtherMount) as exc:  # report, never raise
        return (walk.left if walk else []) + [f"{path}: {getattr(exc, 'strerror', None) or exc}"]
    finally:
        if walk is not None:
            walk.restart()
            if walk.fds[0] >= 0:
                os.close(walk.fds[0])
        os.close(pfd)


class Cleaner:
    """One background thread removing work directories in order. `drain()` waits until all are gone."""

    def __init__(self):
        self._cond = threading.Condition()
        self._queue: list[tuple[str, object]] = []
        self._busy = False
        self._thread: threading.Thread | None = None
        self.failures: list[str] = []  # what could not be removed (logged once per directory)
        self.removed_by: set[int] = set()  # thread idents that removed directories (tests check it is not theirs)

    def submit(self, path: str, done=None) -> None:
        """Queue `path` for removal; `done()` is called (from the cleaner thread) once it has been tried."""
        with self._cond:
            self._queue.append((path, done))
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
                path, done = self._queue.pop(0)
                self._busy = True
            try:
                left = remove_tree(path)
            except BaseException as exc:  # noqa: BLE001 - the cleaner must outlive anything a tree does
                left = [f"{path}: {type(exc).__name__}: {exc}"]
            self.removed_by.add(threading.get_ident())
            if left:
                self.failures.extend(left)
                print(f"warning: sandbox cleanup left {len(left)} entries, first: {left[0]}", file=sys.stderr)
            if done is not None:
                try:
                    done()
                except BaseException as exc:  # noqa: BLE001
                    print(f"warning: sandbox cleanup callback: {exc}", file=sys.stderr)
            with self._cond:
                self._busy = False
                self._cond.notify_all()


CLEANER = Cleaner()
# At interpreter exit, whatever is queued is still removed (the thread is a daemon, so exit would not wait).
atexit.register(CLEANER.drain)
