"""Failures of the environment at start-up, said in one line and exit 2 by every command (megagspo.cli), not as
a traceback from inside a library's import:

    a missing or broken dependency   `import torch` (or Megatron-Core, transformers, ...) raising anything: the line
                                     names the library, the error's first line, and the way on (make install)
    an unusable locale / encoding    a library that fails on the locale while it imports (locale.Error, a codec
                                     error): the line adds LC_ALL / LANG / PYTHONIOENCODING; output itself never
                                     fails on a character the terminal's encoding lacks (backslash escapes)
    a path that cannot be decoded    an argument holding bytes that are not UTF-8 (Python keeps them as
                                     surrogates; writing them to config.yaml, JSON or a log raised much later):
                                     the line names the option or key and shows the bytes

A failure inside the project's own code is not the environment's: it keeps its traceback (a bug to report).
Standard library only: imported before torch, right after the signal guard (megagspo.interrupts) is armed.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from typing import List, Optional

PROJECT = ("megagspo", "moe")
_PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_IMPORT = re.compile(r"^\s*(?:from\s+(\.*[\w.]*)\s+import\b|import\s+([\w.]+))")
# Characters the CLI's own lines print (the report's KL(old‖θ), ±, Δ, →): a stream that cannot encode them gets
# escapes instead of a UnicodeEncodeError in the middle of a run.
_OWN_CHARACTERS = "‖θ±Δ→…"


def make_output_safe() -> None:
    """stdout / stderr whose encoding lacks characters the CLI prints (PYTHONIOENCODING=ascii, a latin-1 locale)
    write them as backslash escapes rather than raising."""
    for stream in (sys.stdout, sys.stderr):
        encoding = getattr(stream, "encoding", None) or "utf-8"
        try:
            _OWN_CHARACTERS.encode(encoding)
        except (UnicodeEncodeError, LookupError):
            reconfigure = getattr(stream, "reconfigure", None)
            if reconfigure is not None:
                reconfigure(errors="backslashreplace")


def _undecodable(word: str) -> bool:
    try:
        word.encode("utf-8")
    except UnicodeEncodeError:  # surrogates: bytes the filesystem encoding could not decode
        return True
    return False


def _shown(word: str) -> str:
    """The argument as the bytes it was given: undecodable ones as \\xNN."""
    return os.fsencode(word).decode("utf-8", "backslashreplace")


def undecodable_argument(words: List[str]) -> Optional[str]:
    """The one line for the first argument that is not UTF-8 (or a working directory that is not), else None.
    Names the option (`--config`) or the key (`log.out_dir`) it sets."""
    for i, word in enumerate(words):
        if not _undecodable(word):
            continue
        if "=" in word and not word.startswith("-"):
            key, _, value = word.partition("=")
            what = f"{_shown(key)} = '{_shown(value)}'"
        elif i > 0 and words[i - 1].startswith("--"):
            what = f"{words[i - 1]} '{_shown(word)}'"
        else:
            what = f"the argument '{_shown(word)}'"
        return (f"{what} is not UTF-8 text (its bytes cannot be decoded); megagspo writes paths into config.yaml, "
                "JSON files and logs as UTF-8: rename it, or pass a UTF-8 path")
    try:
        cwd = os.getcwd()
    except OSError:
        return None
    if _undecodable(cwd):
        return (f"the working directory '{_shown(cwd)}' is not UTF-8 text (its bytes cannot be decoded); relative "
                "paths resolve under it and are written as UTF-8: run from a folder whose path is UTF-8")
    return None


def _package_of(filename: str) -> Optional[str]:
    """The top-level package a library file belongs to, from the sys.path entry it lies under."""
    path = os.path.abspath(filename)
    for entry in sorted((p for p in sys.path if p), key=len, reverse=True):
        entry = os.path.abspath(entry)
        if path.startswith(entry + os.sep):
            first = path[len(entry) + 1:].split(os.sep)[0]
            return first[:-3] if first.endswith(".py") else first
    return None


def _in_project(filename: str) -> bool:
    path = os.path.abspath(filename)
    return any(path.startswith(os.path.join(_PROJECT_ROOT, name) + os.sep) for name in PROJECT)


def _failed_library(exc: BaseException) -> Optional[str]:
    """The library whose import raised `exc`, or None when the failure is the project's own. The deepest project
    frame must be an import statement of a library (`import torch`, `from megatron.core import ...`)."""
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        top = exc.name.split(".")[0]
        return None if top in PROJECT else top
    frames = traceback.extract_tb(exc.__traceback__)
    project = [i for i, f in enumerate(frames) if _in_project(f.filename)]
    if not project or project[-1] == len(frames) - 1:  # the project's own code raised: not the environment
        return None
    match = _IMPORT.match(frames[project[-1]].line or "")
    if not match:  # a call into a library at run time: its error is handled (or not) where it is called
        return None
    module = match.group(1) or match.group(2)
    if module.startswith(".") or module.split(".")[0] in PROJECT:
        # the project imports its own module, which imported the library from a frame already counted; where the
        # next frame is a library file, that library
        nxt = frames[project[-1] + 1]
        lib = _package_of(nxt.filename) if not nxt.filename.startswith("<") else None
        return None if lib is None or lib in PROJECT else lib
    return module.split(".")[0]


def _locale_hint(exc: BaseException) -> str:
    import locale

    if not isinstance(exc, (locale.Error, UnicodeError, LookupError)) and "locale" not in str(exc).lower():
        return ""
    settings = ", ".join(f"{name}={os.environ[name]!r}" for name in ("LC_ALL", "LC_CTYPE", "LANG", "PYTHONIOENCODING")
                         if os.environ.get(name)) or "no LC_ALL / LANG set"
    return f"; the locale or encoding is unusable ({settings}): set LANG=C.UTF-8 (or another installed UTF-8 locale)"


def import_failure(exc: BaseException) -> Optional[str]:
    """The one line for an exception that a library's import raised (a missing or broken dependency, an unusable
    locale), or None when it is not one (the caller re-raises)."""
    if not isinstance(exc, Exception):
        return None
    library = _failed_library(exc)
    if library is None:
        return None
    cause = (str(exc).strip().splitlines() or [""])[0][:300]
    if isinstance(exc, ModuleNotFoundError):
        what = f"the Python package '{library}' is not installed ({cause})"
    else:
        what = f"importing '{library}' failed: {type(exc).__name__}: {cause}"
    return (f"{what}{_locale_hint(exc)}; this is the Python environment ({sys.executable}), not the recipe: "
            "install the project's requirements (make install)")


__all__ = ["import_failure", "make_output_safe", "undecodable_argument"]
