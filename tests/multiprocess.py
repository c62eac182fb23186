"""Run a test body in N spawned gloo processes and bring back each rank's result or traceback.

    from multiprocess import run_distributed

    def _body(rank, world_size, scale):          # module level, so `spawn` can pickle it
        t = torch.full((2,), float(rank)) * scale
        torch.distributed.all_reduce(t)
        return t

    def test_allreduce():
        results = run_distributed(_body, world_size=2, args=(3.0,))
        assert torch.equal(results[0], results[1])

Each child gets MASTER_ADDR/MASTER_PORT (a free port chosen by the parent), RANK, WORLD_SIZE,
LOCAL_RANK, one intra-op thread (N processes share the CI box's 2 cores), and an initialised process
group (gloo; `cpu:gloo,cuda:nccl` when the test's `env` asks for CUDA, see `process_group_backend`) that is
destroyed after the body returns. Every child is pinned to the CPU (`CPU_PINNED_ENV`:
MEGAGSPO_DEVICE=cpu, see moe/device.py, and no visible GPU), also on a GPU host: the ranks of one test would
share its GPU and NCCL cannot run two ranks on one GPU, so these tests run gloo + the CPU shim, the
configuration they were written and measured on. `cpu_pinned_env()` gives the same pinning to tests that
start `megagspo` CLIs or torchrun as subprocesses. The body's return value (tensors are moved to
CPU) comes back in rank order. A failing child's full traceback is raised in the parent; a body that
runs past `timeout_s` has every child killed and the test fails naming the ranks still running.

Start method: a call whose children get this process's environment plus CPU_PINNED_ENV (no `env` override)
forks them from a fork server that imported torch, Megatron-Core and the project once under that same
environment (tests/forkserver_preload.py): fresh processes for every test, forked from a server that never runs a
test body, without a fresh interpreter's ~5 s of imports per rank. torch, Megatron and the project read some
variables when imported or when CUDA starts (CUDA_VISIBLE_DEVICES, TRITON_INTERPRET, TRANSFORMERS_VERBOSITY, ...):
once this process's environment differs from the server's (an in-process `megagspo` run set a variable), a new
server is started under it; a call with `env` overrides (CUDA's) is spawned as before. A forked child gets this process's whole environment (PYTEST_CURRENT_TEST
included), its current stdout / stderr (pytest's capture of the running test) and fresh random seeds (torch's,
numpy's; Python's `random` reseeds itself). What forked children still share, unlike spawned ones: the str hash
seed (set iteration order) of the server. MEGAGSPO_TEST_START=spawn spawns every call.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import sys
import traceback
from multiprocessing import forkserver, reduction
from typing import Any, Callable, Iterator, Sequence

import torch

from moe.parallel import free_port


# MEGAGSPO_DEVICE=cpu: moe.device.use_cuda() is False (gloo, the CPU shim, the model on the CPU).
# CUDA_VISIBLE_DEVICES="": torch sees no GPU either, so nothing in the process (Megatron included) takes a CUDA
# path on a GPU host that it would not take on a CPU host.
CPU_PINNED_ENV = {"MEGAGSPO_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""}


def cpu_pinned_env(base: dict | None = None, **extra: str) -> dict:
    """`base` (default: this process's environment) plus CPU_PINNED_ENV plus `extra`: the `env=` of a subprocess
    (a `megagspo` CLI, torchrun, `python -c`) that must run on the CPU also on a GPU host."""
    env = dict(os.environ if base is None else base)
    env.update(CPU_PINNED_ENV)
    env.update(extra)
    return env


@contextlib.contextmanager
def _parent_environ(env: dict) -> Iterator[None]:
    """`env` set in this process while children are started: a spawned child inherits it from its first
    instruction, before its imports (one of which could initialise CUDA) run."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class DistributedTestError(AssertionError):
    """A child rank failed, hung or died; the message carries its traceback."""


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def process_group_backend(env: dict) -> str:
    """The children's backend: gloo, plus NCCL for CUDA tensors when the child runs on CUDA
    (env MEGAGSPO_DEVICE=cuda). Gloo alone on CUDA tensors is not enough: the distributed optimizer's
    parameter all-gather runs all_gather_into_tensor in a coalescing manager, and gloo's coalesced all-gather
    on CUDA tensors segfaults (pytorch/pytorch#152645)."""
    return "cpu:gloo,cuda:nccl" if env.get("MEGAGSPO_DEVICE", "").strip().lower() == "cuda" else "gloo"


class _ParentStdio:
    """This process's stdout and stderr (fds 1, 2) as they are when a child is started, for a child forked from
    the fork server, whose own are those of the moment it started. Pickled only into forkserver children."""

    def __init__(self, out=None, err=None):
        self.out, self.err = out, err

    def __reduce__(self):
        return (_ParentStdio, (reduction.DupFd(1), reduction.DupFd(2)))

    def install(self) -> None:
        for wrapped, fd in ((self.out, 1), (self.err, 2)):
            received = wrapped.detach()
            os.dup2(received, fd)
            os.close(received)


# The CPU generator's seed when torch seeds it deterministically at import (c10's default_rng_seed_val).
_TORCH_DETERMINISTIC_SEED = 67280421310721


def _reseed_like_a_fresh_interpreter() -> None:
    """A forked child starts with the fork server's random state; a fresh interpreter seeds torch's CPU generator
    at import (non-deterministically in torch 2.13, else to _TORCH_DETERMINISTIC_SEED, kept then) and numpy's
    global generator from the OS. Python's `random` reseeds itself after a fork."""
    if torch.initial_seed() != _TORCH_DETERMINISTIC_SEED:
        torch.default_generator.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()


def _child(fn, rank, world_size, port, args, kwargs, env, queue, environ=None, stdio=None):
    if stdio is not None:
        stdio.install()
    if environ is not None:  # forked from the fork server: this process's environment and random state are its
        for key in set(os.environ) - set(environ):
            del os.environ[key]
        os.environ.update(environ)
        _reseed_like_a_fresh_interpreter()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    try:
        backend = process_group_backend(env)
        if backend != "gloo":  # one GPU per rank, bound before NCCL starts (as moe.parallel.init_distributed does)
            torch.cuda.set_device(rank)
        torch.distributed.init_process_group(backend, rank=rank, world_size=world_size)
        try:
            result = fn(rank, world_size, *args, **kwargs)
        finally:
            torch.distributed.destroy_process_group()
        # Plain bytes: torch's queue pickler would share tensor storage through file descriptors that
        # die with this process before the parent reads them.
        buffer = io.BytesIO()
        torch.save(_to_cpu(result), buffer)
        queue.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent with its traceback
        queue.put((rank, False, traceback.format_exc()))


# The parent picks a free port and closes it; the ranks bind it later, so another process on a shared machine
# can take it in between. That failure is the harness's, not the test's: it is retried with a new port.
_PORT_TAKEN = ("EADDRINUSE", "Address already in use")
PORT_ATTEMPTS = 3


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    kwargs: dict | None = None,
    timeout_s: float = 300.0,
    env: dict | None = None,
) -> list[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` gloo ranks, pinned to the CPU
    (CPU_PINNED_ENV, which `env` may override); return results by rank."""
    for attempt in range(PORT_ATTEMPTS):
        try:
            return _run_once(fn, world_size, args, kwargs, timeout_s, env)
        except DistributedTestError as exc:
            if attempt == PORT_ATTEMPTS - 1 or not any(m in str(exc) for m in _PORT_TAKEN):
                raise
            print(f"run_distributed: rendezvous port taken by another process; retrying {fn.__name__} on a new port")
    raise AssertionError("unreachable")


# Set by pytest for each test: a forked child gets this process's value, so it does not decide the start method.
_PER_TEST_ENV = ("PYTEST_CURRENT_TEST",)
START_ENV = "MEGAGSPO_TEST_START"
_forkserver_environ: dict | None = None  # the environment (minus _PER_TEST_ENV) the fork server started under
_old_forkservers: list[int] = []  # pids of servers let go (_let_the_forkserver_go), until reaped


def _environ_for(child_env: dict) -> dict:
    environ = {**os.environ, **child_env}
    for key in _PER_TEST_ENV:
        environ.pop(key, None)
    return environ


def _let_the_forkserver_go() -> bool:
    """Ask the fork server to exit (it does once every process holding its 'alive' pipe closed it; our children
    are gone by now) so that the next start starts a new one under this environment. Python 3.11's
    ForkServer._stop() would wait for that exit, which a process forked from this one (and holding the pipe)
    could delay; this closes the pipe and forgets the server without waiting. False where this Python's
    ForkServer lacks the attributes used."""
    server = forkserver._forkserver
    if not all(hasattr(server, a) for a in ("_lock", "_forkserver_pid", "_forkserver_alive_fd",
                                            "_forkserver_address")):
        return False
    with server._lock:
        if server._forkserver_pid is not None:
            os.close(server._forkserver_alive_fd)
            _old_forkservers.append(server._forkserver_pid)
            server._forkserver_pid = server._forkserver_alive_fd = server._forkserver_address = None
    return True


def _reap_old_forkservers() -> None:
    """Wait for the servers let go that have exited (no zombie left behind), without blocking."""
    for pid in list(_old_forkservers):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            _old_forkservers.remove(pid)


def _start_method(child_env: dict) -> str:
    """'forkserver' when the children's environment is the default one (CPU_PINNED_ENV over this process's), else
    'spawn' (see the module docstring). A fork server started under another environment is replaced."""
    global _forkserver_environ
    _reap_old_forkservers()
    if child_env != CPU_PINNED_ENV or os.environ.get(START_ENV, "").strip() == "spawn":
        return "spawn"
    environ = _environ_for(child_env)
    if _forkserver_environ is None:
        mp.get_context("forkserver").set_forkserver_preload(["forkserver_preload"])
    elif environ != _forkserver_environ:  # changed since the server started (an in-process run set a variable)
        if not _let_the_forkserver_go():
            return "spawn"
    _forkserver_environ = environ
    # Python 3.11's fork server ignores this process's sys.path while it preloads: PYTHONPATH finds
    # forkserver_preload (tests/) there. A child's sys.path and environment are this process's (see _child).
    here = os.path.dirname(os.path.abspath(__file__))
    pythonpath = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    with _parent_environ({**child_env, "PYTHONPATH": pythonpath}):
        forkserver.ensure_running()  # started on the first call, restarted if it died
    return "forkserver"


def _run_once(fn, world_size, args, kwargs, timeout_s, env) -> list[Any]:
    child_env = {**CPU_PINNED_ENV, **(env or {})}
    method = _start_method(child_env)
    ctx = mp.get_context(method)
    queue = ctx.Queue()
    port = free_port()
    # forked children take the whole environment (the server's is that of its start) and the current stdio
    inherit = (dict(os.environ, **child_env), _ParentStdio()) if method == "forkserver" else (None, None)
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, rank, world_size, port, tuple(args), dict(kwargs or {}), child_env, queue, *inherit),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    with _parent_environ(child_env):
        for proc in procs:
            proc.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                running = sorted(set(range(world_size)) - set(results) - set(failures))
                detail = "".join(f"\n--- rank {r} failed ---\n{tb}" for r, tb in failures.items())
                raise DistributedTestError(
                    f"{fn.__name__}: ranks {running} still running after {timeout_s:.0f} s; killed{detail}"
                )
            try:
                rank, ok, payload = queue.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [
                    r for r, p in enumerate(procs)
                    if not p.is_alive() and p.exitcode not in (0, None) and r not in results and r not in failures
                ]
                if dead and queue.empty():
                    # A rank died without reporting (segfault, OOM kill): its peers would hang on it.
                    codes = {r: procs[r].exitcode for r in dead}
                    detail = "".join(f"\n--- rank {r} failed ---\n{tb}" for r, tb in failures.items())
                    raise DistributedTestError(f"{fn.__name__}: ranks died without a result, exit codes {codes}{detail}")
                continue
            if ok:
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                failures[rank] = payload
                # The first failure usually leaves its peers blocked in a collective: stop waiting for them.
                break
        if failures:
            detail = "".join(f"\n--- rank {r} traceback ---\n{tb}" for r, tb in sorted(failures.items()))
            raise DistributedTestError(f"{fn.__name__} failed on rank(s) {sorted(failures)}:{detail}")
        return [results[r] for r in range(world_size)]
    finally:
        for proc in procs:
            proc.join(timeout=5 if not failures and len(results) == world_size else 0.5)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        queue.close()
