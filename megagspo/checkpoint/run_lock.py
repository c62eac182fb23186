"""One owner per run folder: an exclusive `fcntl.flock` on `<run>/.megagspo.lock`, taken before anything in
the folder is written or moved, and held for the life of the process.

The kernel drops a flock when its owner's file descriptor closes — at exit, and also when the owner is
SIGKILLed or its host loses the process — so a crashed owner never leaves the folder stuck. The file itself
only tells a refused second process who holds the folder (host, pid, command, start time); it is left in
place and overwritten by the next owner. It is only ever a lock: opened without following symlinks, and refused
(LockFileRefused, naming it) unless it is a regular file of this user with one link, so a symlink planted in a
shared run folder cannot make the next trainer overwrite another file. flock is advisory and per host on some network filesystems (NFS
before v4, some Lustre mounts): the guarantee holds for processes that share the filesystem's lock manager.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import sys
import time

from moe.json_files import loads_bounded

LOCK_FILE = ".megagspo.lock"


_NO_FLOCK = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


class RunFolderBusy(RuntimeError):
    """Another live process owns the run folder; the message names it."""


class LockFileRefused(RunFolderBusy):
    """The lock file is not a plain file of this user (a symlink, a folder, a FIFO, someone else's file): taking
    it would truncate and write whatever it points at. The message names it. (A RunFolderBusy, so every caller
    that turns a refused run folder into a one-line error handles it too.)"""


def _open_lock_file(path: str) -> int:
    """The lock file's descriptor, opened without following a symlink (O_NOFOLLOW) and without blocking on a
    FIFO (O_NONBLOCK), then checked on the descriptor itself (no race with a swap): a regular file owned by this
    user. Nothing is written before the check."""
    rule = "it must be a regular file owned by you; remove it (the run folder is otherwise untouched) and retry"
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | \
        getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EMLINK):
            kind = "a symbolic link" if os.path.islink(path) else "not a regular file"
            raise LockFileRefused(f"run folder lock {path} is {kind}; {rule}") from None
        raise OSError(exc.errno, exc.strerror, path) from None
    st = os.fstat(fd)
    problem = ("not a regular file" if not stat.S_ISREG(st.st_mode) else
               f"owned by uid {st.st_uid}, not by you (uid {os.getuid()})" if st.st_uid != os.getuid() else
               f"has {st.st_nlink} hard links (it may be another file's name)" if st.st_nlink != 1 else None)
    if problem:
        os.close(fd)
        raise LockFileRefused(f"run folder lock {path} is {problem}; {rule}")
    return fd


class RunFolderLock:
    """`with RunFolderLock(run_dir, "megagspo train"):` or `acquire()` / `release()`.

    Re-entrant within one process (a Trainer built in a notebook or a test next to another on the same
    folder): the process keeps one descriptor per folder, counted, because a second flock from the same
    process on a new descriptor would refuse the process itself. Other processes are refused."""

    _held: dict = {}  # realpath -> [fd, holders] of the folders this process owns

    def __init__(self, run_dir: str, purpose: str) -> None:
        self.run_dir = run_dir
        self.purpose = purpose
        self.path = os.path.join(run_dir, LOCK_FILE)
        self._key = None

    def acquire(self) -> "RunFolderLock":
        if self._key is not None:
            return self
        os.makedirs(self.run_dir, exist_ok=True)
        key = os.path.join(os.path.realpath(self.run_dir), LOCK_FILE)  # the folder's identity, not a link's target
        if key in self._held:
            self._held[key][1] += 1
            self._key = key
            return self
        fd = _open_lock_file(self.path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                os.close(fd)
                raise RunFolderBusy(f"run folder {self.run_dir} is in use by {describe_owner(self.path)}; wait "
                                    "for it to finish or stop it, or choose another name= / log.out_dir=") from None
            if exc.errno not in _NO_FLOCK:
                os.close(fd)
                raise OSError(exc.errno, exc.strerror, self.path) from None
            # Lustre without -o flock, NFSv3 with nolock, some FUSE mounts: no lock manager. Refusing would
            # stop every run there; running unguarded is what the user had before, said once and plainly.
            print(f"megagspo: warning: {self.path}: this filesystem offers no file locks ({os.strerror(exc.errno)}); "
                  "the run folder is NOT guarded against a second trainer", file=sys.stderr, flush=True)
        owner = {"host": socket.gethostname(), "pid": os.getpid(), "purpose": self.purpose,
                 "command": " ".join(sys.argv)[:500], "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps(owner) + "\n").encode())
        self._held[key] = [fd, 1]
        self._key = key
        return self

    def release(self) -> None:
        if self._key is None:
            return
        entry = self._held[self._key]
        entry[1] -= 1
        if entry[1] == 0:
            os.close(entry[0])  # closing the descriptor drops the flock
            del self._held[self._key]
        self._key = None

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the process exit drops the flock anyway
            pass

    def __enter__(self) -> "RunFolderLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def describe_owner(lock_path: str) -> str:
    """'megagspo train (pid 123 on host-a, since ...)' from the lock file; what is known when it is unreadable."""
    try:
        fd = os.open(lock_path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, encoding="utf-8") as f:
            owner = loads_bounded(f.read(4096) or "{}", lock_path)
        return (f"{owner.get('purpose', 'another process')} (pid {owner.get('pid', '?')} on "
                f"{owner.get('host', '?')}, since {owner.get('since', '?')})")
    except (OSError, ValueError, AttributeError):
        return f"another process (its lock file {lock_path} is unreadable)"
