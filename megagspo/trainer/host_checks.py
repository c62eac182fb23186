"""The settings whose check needs the machine a run starts on, made in the preflight (so by the dry run too,
`megagspo train --dry-run`), each a ConfigError naming the key. Each failed before only where it is used, after
the cold start or never loudly:

    rollout.producer_cpus   every core id among those this process may run on (os.sched_getaffinity: a
                            container's or a batch job's cgroup grants fewer than os.cpu_count). The producer
                            process pins itself with os.sched_setaffinity, which raised EINVAL in the child after
                            the cold start: six tracebacks, exit 1, the setting never named
    rollout.producer        a producer process can be started from this one: a daemonic multiprocessing child
                            may not start children, which the producer found out when it first started
    reward.name             the `math` verifier's library (math-verify) imports: without it every call raised in
                            the verifier's worker and scored 0, a whole run of zero rewards counted as errors
    log.out_dir             no part of it is a file, and where it exists it is a folder this user may write:
                            the run found out at its first write, after data, tokenizer and model were checked

A dry run on a login node checks against the login node; a recipe for other machines says so in the error.
Standard library only.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os

from megagspo.config import Config, ConfigError

# What check_host checks (tests/test_host_checks.py holds one refused case per key).
HOST_CHECKED = ("rollout.producer_cpus", "rollout.producer", "reward.name", "log.out_dir")


def runs_producer_process(cfg: Config) -> bool:
    """Whether the run starts a rollout producer process: rollout.staleness >= 1 with rollout.producer = process,
    or auto with the embedded engine (megagspo.rl.sources holds the rule and its refusals; this is its yes/no)."""
    producer = cfg.rollout.producer
    if producer == "auto":
        producer = "process" if cfg.rollout.engine == "hf" else "thread"
    return cfg.rollout.staleness >= 1 and producer == "process"


def usable_cores() -> list:
    """The core ids this process may run on (sorted), or [] where the platform cannot say (not Linux)."""
    if not hasattr(os, "sched_getaffinity"):
        return []
    return sorted(os.sched_getaffinity(0))


def _spans(cores: list) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], None
    for i, c in enumerate(cores):
        if start is None:
            start = c
        if i + 1 == len(cores) or cores[i + 1] != c + 1:
            out.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ", ".join(out)


def check_producer_cpus(cpus: list) -> None:
    if not cpus:
        return
    if not hasattr(os, "sched_setaffinity"):
        raise ConfigError(f"rollout.producer_cpus = {cpus}: pinning the producer process needs os.sched_setaffinity, "
                          "which this platform lacks (Linux has it); leave rollout.producer_cpus empty")
    usable = usable_cores()
    absent = sorted(set(cpus) - set(usable))
    if absent:
        raise ConfigError(f"rollout.producer_cpus = {cpus}: core{'s' if len(absent) > 1 else ''} "
                          f"{', '.join(map(str, absent[:8]))}{', ...' if len(absent) > 8 else ''} "
                          f"{'are' if len(absent) > 1 else 'is'} not among the {len(usable)} this process may run "
                          f"on here ({_spans(usable)}; os.cpu_count() = {os.cpu_count()}); name cores of that list, "
                          "or leave it empty (not pinned)")


def check_out_dir(out_dir: str) -> None:
    """No component of log.out_dir is a file; where it exists, a folder this user may write into. A path that does
    not exist yet (a cluster's scratch, seen from a login node) is left to the run, which creates it."""
    path = os.path.abspath(out_dir)
    probe = path
    while not os.path.lexists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            return
        probe = parent
    if not os.path.isdir(probe):
        raise ConfigError(f"log.out_dir = {out_dir!r}: {probe} is a file, not a directory; name a folder")
    if probe == path and not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"log.out_dir = {out_dir!r}: this user may not write into {path} (permission denied); "
                          "name a folder you can write")


def check_host(cfg: Config) -> None:
    """Raise ConfigError naming the first of HOST_CHECKED that cannot work on this machine."""
    if runs_producer_process(cfg):
        check_producer_cpus(list(cfg.rollout.producer_cpus))
        if multiprocessing.current_process().daemon:
            raise ConfigError("rollout.producer = process (or auto with rollout.engine = hf) starts a producer "
                              "process, which this process, a daemonic multiprocessing child, may not start; run "
                              "the trainer from a normal process (the CLI, torchrun) or set rollout.producer = thread")
    if cfg.reward.name == "math" and importlib.util.find_spec("math_verify") is None:
        raise ConfigError("reward.name = 'math' needs the math-verify package, which is not installed here "
                          "(pinned in requirements/base.txt: make install); every verifier call would fail and "
                          "score 0")
    check_out_dir(cfg.log.out_dir)


__all__ = ["HOST_CHECKED", "check_host", "check_out_dir", "check_producer_cpus", "runs_producer_process",
           "usable_cores"]
