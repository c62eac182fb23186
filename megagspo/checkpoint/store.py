"""Checkpoint directories on disk: atomic writes, a manifest with checksums, verification, fallback, pruning.

Layout (one directory per checkpoint; `step` = RL steps completed, 0 = after cold-start SFT):

    <root>/step_000010/             the finished checkpoint
        model/__0_0.distcp, ...     ...payload files, in sub-folders too (see megagspo.checkpoint.state)
        manifest.json               {"format", "step", "files": {relative path: {"bytes", "sha256"}}}, written
                                    LAST, listing every file under the folder
    <root>/step_000012.tmp-<pid>/   a checkpoint being written (never read; removed when stale)

A checkpoint is written into `step_X.tmp-<pid>` (`begin_checkpoint`; under several processes every rank
writes its own shards there), then `commit_checkpoint` adds the remaining files, fsyncs every file, computes
the checksums from what is on disk, writes the manifest last, and only then renames the directory to
`step_X` (one atomic rename on POSIX). A preempted or crashed writer therefore leaves a `.tmp-` directory, never a half-written `step_X`.
Readers trust nothing: `verify` re-checks sizes and sha256 of every file the manifest lists, and
`latest_good` walks back from the newest checkpoint to the first one that verifies, saying which ones it
skipped and why.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from typing import Callable, Dict, List, Optional, Tuple

from moe.checkpoint_errors import CheckpointError  # the one checkpoint error, shared with moe (re-exported)
from moe.json_files import JsonFileError, read_json

FORMAT = "megagspo-checkpoint/2"  # /2: model and optimizer as dist_checkpointing shards
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20  # one entry (~120 bytes) per file: half a million files
_STEP_DIR = re.compile(r"^step_(\d{6,})$")
_TMP_DIR = re.compile(r"^step_\d{6,}\.tmp-(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def sha256_file(path: str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories; the rename is still atomic
        pass
    finally:
        os.close(fd)


def list_checkpoints(root: str) -> List[Tuple[int, str]]:
    """Finished checkpoint directories under root as (step, path), newest first."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            out.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(out, reverse=True)


def _check_name(name: str) -> None:
    parts = name.split("/")
    if name == MANIFEST or os.path.isabs(name) or any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"bad checkpoint file name {name!r}")


def begin_checkpoint(root: str, step: int) -> str:
    """Create the empty temporary folder `step_X.tmp-<pid>` a checkpoint is written into. -> its path."""
    os.makedirs(root, exist_ok=True)
    remove_stale_tmp(root)
    tmp = f"{os.path.join(root, step_dir_name(step))}.tmp-{os.getpid()}"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    return tmp


def _files_under(folder: str) -> List[str]:
    out = []
    for dirpath, _, names in os.walk(folder):
        for name in names:
            out.append(os.path.relpath(os.path.join(dirpath, name), folder).replace(os.sep, "/"))
    return sorted(out)


def commit_checkpoint(root: str, step: int, tmp: str, writers: Dict[str, Callable[[str], None]],
                      extra_manifest: Optional[dict] = None) -> str:
    """Finish a checkpoint begun with `begin_checkpoint`: write `writers` (relative path -> function writing
    that file at the path it is given), fsync and checksum EVERY file under `tmp` (shards written by other
    processes included), write the manifest last, rename to `step_X`. -> the final directory."""
    final = os.path.join(root, step_dir_name(step))
    for name, write in writers.items():
        _check_name(name)
        path = os.path.join(tmp, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write(path)
    files = {}
    for name in _files_under(tmp):
        if name == MANIFEST:
            continue
        path = os.path.join(tmp, name)
        _fsync_path(path)
        files[name] = {"bytes": os.path.getsize(path), "sha256": sha256_file(path)}
    manifest = {"format": FORMAT, "step": step, "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "files": files}
    manifest.update(extra_manifest or {})
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    for dirpath, _, _ in os.walk(tmp):
        _fsync_path(dirpath)
    if os.path.exists(final):  # a re-run of a step (e.g. after resuming past a corrupt one): swap it out
        aside = f"{final}.replaced-{os.getpid()}"
        os.rename(final, aside)
        os.rename(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_path(root)
    return final


def write_checkpoint(root: str, step: int, writers: Dict[str, Callable[[str], None]],
                     extra_manifest: Optional[dict] = None) -> str:
    """Write one checkpoint atomically from one process (begin + commit). -> the final directory. Nothing
    named `step_X` exists until everything is on disk."""
    for name in writers:
        _check_name(name)
    tmp = begin_checkpoint(root, step)
    return commit_checkpoint(root, step, tmp, writers, extra_manifest)


def remove_stale_tmp(root: str) -> None:
    """Delete `.tmp-<pid>` / `.replaced-<pid>` directories whose writer process is gone."""
    for name in os.listdir(root):
        m = _TMP_DIR.match(name) or re.match(r"^step_\d{6,}\.replaced-(\d+)$", name)
        if not m:
            continue
        pid = int(m.group(1))
        alive = pid != os.getpid()
        if alive:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                alive = False
            except PermissionError:
                alive = True
        if not alive or pid == os.getpid():
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def prune(root: str, keep_last: int) -> List[str]:
    """Delete all but the newest `keep_last` finished checkpoints. -> deleted paths."""
    deleted = []
    for _, path in list_checkpoints(root)[keep_last:]:
        shutil.rmtree(path, ignore_errors=True)
        deleted.append(path)
    return deleted


def verify(path: str, required: Tuple[str, ...] = ()) -> Optional[str]:
    """None when the checkpoint directory is intact, else the reason it is not (one line). A folder that
    disappears while it is checked (pruned by a running trainer) gives VANISHED, never an exception."""
    try:
        return _verify(path, required)
    except OSError as exc:
        if not os.path.isdir(path):
            return VANISHED
        return f"a file cannot be read ({type(exc).__name__}: {exc.strerror or exc})"


VANISHED = "removed while it was being read (pruned by a running trainer?)"


def vanished(path: str, reason: Optional[str]) -> bool:
    """Whether `reason` (a check of `path` that failed) is only that the folder is gone: not corruption."""
    return reason == VANISHED or (reason is not None and not os.path.isdir(path))


def _verify(path: str, required: Tuple[str, ...]) -> Optional[str]:
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isfile(mpath):
        return "no manifest.json (the write did not finish)"
    try:
        manifest = read_json(mpath, max_bytes=MAX_MANIFEST_BYTES, want=None)
    except JsonFileError as exc:
        return f"manifest.json is unreadable ({str(exc).replace(mpath + ': ', '', 1)})"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return f"manifest.json has format {manifest.get('format') if isinstance(manifest, dict) else None!r}, " \
               f"expected {FORMAT!r}"
    files = manifest.get("files")
    if not isinstance(files, dict):
        return "manifest.json lists no files"
    for name in required:
        if name not in files:
            return f"manifest.json does not list {name}"
    for name, meta in files.items():
        if not isinstance(name, str) or not isinstance(meta, dict):
            return "manifest.json has a malformed file entry"
        try:
            _check_name(name)
        except ValueError:
            return f"manifest.json lists {name!r}, a path outside the checkpoint folder"
        fpath = os.path.join(path, name)
        if not os.path.isfile(fpath):
            return f"{name} is missing"
        size = os.path.getsize(fpath)
        if size != meta.get("bytes"):
            return f"{name} has {size} bytes, the manifest says {meta.get('bytes')} (truncated or overwritten)"
        digest = sha256_file(fpath)
        if digest != meta.get("sha256"):
            return f"{name} sha256 {digest[:12]}... does not match the manifest's {str(meta.get('sha256'))[:12]}..."
    return None


def latest_good(root: str, required: Tuple[str, ...] = (), say: Callable[[str], None] = print,
                check: Optional[Callable[[str], Optional[str]]] = None) -> Optional[str]:
    """The newest checkpoint under root that verifies, or None when root holds no checkpoints.

    `check(path)` (default: `verify(path, required)`) -> None or the reason. Corrupt ones are skipped with
    "checkpoint step_X is corrupt (<reason>); falling back to step_Y" (said via `say`); one that vanishes while
    it is checked (a running trainer pruned it) is skipped as pruned, not as corrupt, and the folder is listed
    again (newer ones may have appeared). Raises CheckpointError when there are checkpoints but none verifies."""
    check = check or (lambda p: verify(p, required))
    reasons = []
    seen = set()
    for _ in range(_RESCANS):
        found = [(s, p) for s, p in list_checkpoints(root) if p not in seen]
        if not found:
            break
        pruned = False
        for i, (_, path) in enumerate(found):
            seen.add(path)
            reason = check(path)
            if reason is None:
                return path
            nxt = os.path.basename(found[i + 1][1]) if i + 1 < len(found) else None
            if vanished(path, reason):
                say(f"checkpoint {os.path.basename(path)} was pruned while being read (a trainer still writes "
                    f"this run?); taking the next newest")
                pruned = True
                break
            reasons.append(f"{os.path.basename(path)}: {reason}")
            say(f"checkpoint {os.path.basename(path)} is corrupt ({reason}); "
                + (f"falling back to {nxt}" if nxt else "no older checkpoint left"))
        if not pruned:
            break
    if not reasons and not seen:
        return None
    if not reasons:
        raise CheckpointError(f"every checkpoint under {root} was pruned while being read (is a trainer still "
                              "writing this run? try again, or export once it has finished)")
    raise CheckpointError(f"no intact checkpoint under {root}: " + "; ".join(reasons))


_RESCANS = 5  # listings of a folder whose checkpoints keep vanishing (a trainer pruning) before giving up


def read_manifest(path: str) -> dict:
    return read_json(os.path.join(path, MANIFEST), max_bytes=MAX_MANIFEST_BYTES)
