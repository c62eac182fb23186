"""What a filesystem failure means, in one line: `os_error_message` names the path and the cause (disk full,
read-only, permission denied, not a directory, ...), and `write_failure_message` finds that cause behind
the wrappers a library puts around it (Megatron's checkpoint writer reports a full disk as
"unexpected pos 704 vs 598" with no errno: the free space left on the target tells it apart). And ConfigError,
the one error type of a bad configuration, here so that the config loader and the modules below it share it."""

from __future__ import annotations

import errno
import os
import reprlib
import shutil
from typing import Any


class ConfigError(ValueError):
    """A configuration key is unknown, missing or out of range; the message names it."""

_CAUSES = {
    errno.ENOSPC: "disk full (no space left on device)",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only filesystem",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOENT: "no such file or directory",
    errno.ENOTDIR: "a path component is not a directory",
    errno.EISDIR: "is a directory, a file was expected",
    errno.EEXIST: "already exists",
    errno.ENAMETOOLONG: "file name too long",
    errno.EMFILE: "too many open files in this process",
    errno.ENFILE: "too many open files on this system",
    errno.EIO: "input/output error (failing disk or network filesystem)",
    errno.EFBIG: "file too large for this filesystem or the process's file size limit",
    errno.ELOOP: "too many levels of symbolic links",
    errno.EXDEV: "cannot move across filesystems",
    errno.ENOLCK: "no locks available on this filesystem",
    errno.ENOSYS: "not supported by this filesystem",
    errno.EOPNOTSUPP: "not supported by this filesystem",
    errno.ENOTEMPTY: "directory not empty",
    errno.EBUSY: "device or resource busy",
    errno.ESTALE: "stale network file handle",
}
# Below this much free space right after a failed write (before its partial files are removed), the write
# failed because the disk is full: a writer that meets ENOSPC has used up the space to the last block.
LOW_SPACE_BYTES = 1 << 20


def os_error_message(exc: OSError) -> str:
    """'<path>: <cause>' (both paths for a rename), e.g. 'runs/x/metrics.jsonl: disk full (no space left on device)'."""
    cause = _CAUSES.get(exc.errno) or (exc.strerror.lower() if exc.strerror else str(exc) or type(exc).__name__)
    where = _cut_path(exc.filename) if exc.filename is not None else ""
    if exc.filename2 is not None:
        where = f"{where} -> {_cut_path(exc.filename2)}"
    return f"{where}: {cause}" if where else cause


def _cut_path(path, limit: int = 300) -> str:
    """A path from user input, cut for a one-line message (a 10 MB path is refused as too long, not printed)."""
    text = os.fsdecode(path) if isinstance(path, (bytes, os.PathLike)) else str(path)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _os_error_in_chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def free_bytes(path: str):
    """Free bytes on the filesystem holding `path` (its nearest existing ancestor); None when unknown."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


MAX_MESSAGE = 4000  # an error names its inputs cut to ~200 characters each; this bounds what any message prints


def bounded_message(exc: BaseException, limit: int = MAX_MESSAGE) -> str:
    """The message of an error printed to the user, cut to `limit` characters with its length said: a message
    built around a hostile input (a 10 MB name, key or value) must never become a 10 MB line."""
    text = str(exc)
    return text if len(text) <= limit else f"{text[:limit]}... (cut: the message has {len(text)} characters)"


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message, cut to `limit` characters: libraries put tracebacks and
    tables into messages that a one-line error must not carry."""
    return (str(exc).strip().splitlines() or [""])[0][:limit]


def write_failure_message(exc: BaseException, target: str) -> str:
    """One line saying why writing under `target` failed; call it before cleaning up the partial files."""
    os_exc = _os_error_in_chain(exc)
    if os_exc is not None:
        return os_error_message(os_exc)
    said = first_line(exc)
    free = free_bytes(target)
    if free is not None and free < LOW_SPACE_BYTES:
        return (f"{target}: disk full ({free} bytes left on its filesystem; the writer said: "
                f"{type(exc).__name__}: {said})")
    return f"{type(exc).__name__}: {said}"


# A value printed in an error message is cut to a readable size: a YAML alias bomb's value is a few KB on disk
# but billions of elements when written out in full.
_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 120
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxdict = _SHOWN.maxset = 8
_SHOWN.maxlevel = 3


def show_value(value: Any, limit: int = 200) -> str:
    """A value as an error message shows it: reprlib never writes the whole nested value out."""
    text = _SHOWN.repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
