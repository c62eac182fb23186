"""The gloo multi-process harness: results by rank, child tracebacks surfaced, hangs killed."""

from __future__ import annotations

import time

import pytest
import torch

import multiprocess
from multiprocess import DistributedTestError, run_distributed


def _allreduce_body(rank, world_size, scale):
    tensor = torch.full((3,), float(rank + 1)) * scale
    torch.distributed.all_reduce(tensor)
    return {"rank": rank, "sum": tensor}


def _failing_body(rank, world_size):
    if rank == 1:
        raise ValueError("rank one refuses")
    return rank


def _hanging_body(rank, world_size):
    if rank == 0:
        time.sleep(600)
    return rank


@pytest.mark.multiprocess
def test_results_come_back_in_rank_order():
    results = run_distributed(_allreduce_body, world_size=3, args=(2.0,))
    assert [r["rank"] for r in results] == [0, 1, 2]
    for r in results:
        torch.testing.assert_close(r["sum"], torch.full((3,), 12.0), rtol=0, atol=0)


@pytest.mark.multiprocess
def test_child_traceback_is_raised_in_parent():
    with pytest.raises(DistributedTestError, match=r"(?s)rank\(s\) \[1\].*ValueError: rank one refuses"):
        run_distributed(_failing_body, world_size=2)


@pytest.mark.multiprocess
def test_hanging_rank_is_killed_after_timeout():
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"ranks \[0\] still running"):
        run_distributed(_hanging_body, world_size=2, timeout_s=10)
    assert time.monotonic() - start < 60


def _port_taken_once_body(rank, world_size, marker):
    import os

    if not os.path.exists(marker):
        if rank == 0:
            open(marker, "w").close()
        raise RuntimeError("The server socket has failed to listen on any local network address. "
                           "port: 12345, useIpv6: 0, code: -98, name: EADDRINUSE, message: address already in use")
    return rank


@pytest.mark.multiprocess
def test_a_taken_rendezvous_port_is_retried_but_a_real_failure_is_not(tmp_path):
    # rank 1 may race rank 0's marker; either way the first attempt fails with EADDRINUSE on some rank
    assert run_distributed(_port_taken_once_body, world_size=2, args=(str(tmp_path / "marker"),)) == [0, 1]
    with pytest.raises(DistributedTestError, match="rank one refuses"):
        run_distributed(_failing_body, world_size=2)


def _device_body(rank, world_size):
    import os

    from moe.device import model_device, use_cuda

    return {"MEGAGSPO_DEVICE": os.environ.get("MEGAGSPO_DEVICE"), "CUDA_VISIBLE_DEVICES": os.environ.get(
        "CUDA_VISIBLE_DEVICES"), "use_cuda": use_cuda(), "model_device": str(model_device()),
        "cuda_available": torch.cuda.is_available(), "backend": torch.distributed.get_backend()}


@pytest.mark.multiprocess
def test_workers_are_pinned_to_the_cpu_also_on_a_gpu_host():
    """NCCL cannot run two ranks on one GPU: every worker runs gloo on the CPU, whatever this host has, and the
    parent's environment is left as it was."""
    import os

    before = {k: os.environ.get(k) for k in ("MEGAGSPO_DEVICE", "CUDA_VISIBLE_DEVICES")}
    for report in run_distributed(_device_body, world_size=2):
        assert report == {"MEGAGSPO_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": "", "use_cuda": False,
                          "model_device": "cpu", "cuda_available": False, "backend": "gloo"}, report
    assert {k: os.environ.get(k) for k in before} == before


def test_cpu_pinned_env_for_subprocesses():
    from multiprocess import cpu_pinned_env

    env = cpu_pinned_env({"PATH": "/bin", "MEGAGSPO_DEVICE": "cuda"}, OMP_NUM_THREADS="1")
    assert env == {"PATH": "/bin", "MEGAGSPO_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


def test_cuda_children_get_nccl_for_cuda_tensors():
    """A child asked to run on CUDA gets `cpu:gloo,cuda:nccl`: gloo alone on CUDA tensors segfaults in the
    distributed optimizer's coalesced all-gather (pytorch/pytorch#152645); CPU children keep plain gloo."""
    from multiprocess import CPU_PINNED_ENV, process_group_backend

    assert process_group_backend(CPU_PINNED_ENV) == "gloo"
    assert process_group_backend({}) == "gloo"
    assert process_group_backend({"MEGAGSPO_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": "0"}) == "cpu:gloo,cuda:nccl"
    assert process_group_backend({"MEGAGSPO_DEVICE": " CUDA "}) == "cpu:gloo,cuda:nccl"


def _backend_body(rank, world_size):
    import torch.distributed as dist

    return {"backend": str(dist.get_backend()), "device": torch.cuda.current_device()}


@pytest.mark.gpu
@pytest.mark.multiprocess
def test_cuda_child_runs_nccl_on_its_gpu():
    import os

    env = {"MEGAGSPO_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
    (report,) = run_distributed(_backend_body, world_size=1, env=env)
    assert "nccl" in report["backend"] and report["device"] == 0, report


def _process_body(rank, world_size):
    import os
    import sys

    return {"pid": os.getpid(), "ppid": os.getppid(), "preloaded": "megatron.core" in sys.modules,
            "draw": float(torch.rand(())), "initial_seed": torch.initial_seed(),
            "test": os.environ.get("PYTEST_CURRENT_TEST"), "probe": os.environ.get("MEGAGSPO_HARNESS_PROBE")}


@pytest.mark.multiprocess
def test_default_calls_fork_fresh_children_from_a_preloaded_single_threaded_server():
    """Every call gets new processes, forked from the fork server (never from this process), which imported
    Megatron once and runs no thread besides its main one; each child draws from its own torch seed as a fresh
    interpreter does, and sees this test's PYTEST_CURRENT_TEST."""
    import os

    first, second = run_distributed(_process_body, world_size=2), run_distributed(_process_body, world_size=2)
    reports = first + second
    assert len({r["pid"] for r in reports}) == 4, reports
    server = first[0]["ppid"]
    assert server != os.getpid() and all(r["ppid"] == server for r in reports), reports
    assert len(os.listdir(f"/proc/{server}/task")) == 1, "the fork server runs threads a forked child would lose"
    assert all(r["preloaded"] for r in reports), reports
    assert all(r["test"] == os.environ["PYTEST_CURRENT_TEST"] for r in reports), reports
    if first[0]["initial_seed"] != multiprocess._TORCH_DETERMINISTIC_SEED:  # torch seeds at import, not fixed
        assert len({r["draw"] for r in reports}) == 4, reports


@pytest.mark.multiprocess
def test_a_changed_environment_gets_a_new_fork_server_and_an_env_override_spawns(monkeypatch):
    """The fork server imported under the environment it started with: a default call made under another one
    gets a new server started under it; a call with `env` overrides is spawned from this process."""
    import os

    (before, _) = run_distributed(_process_body, world_size=2)
    monkeypatch.setenv("MEGAGSPO_HARNESS_PROBE", "1")
    reports = run_distributed(_process_body, world_size=2)
    server = reports[0]["ppid"]
    assert server not in (before["ppid"], os.getpid()), (before, reports)
    assert all(r["ppid"] == server and r["probe"] == "1" and r["preloaded"] for r in reports), reports
    with open(f"/proc/{server}/environ", "rb") as f:
        assert b"MEGAGSPO_HARNESS_PROBE=1" in f.read().split(b"\0")
    for report in run_distributed(_process_body, world_size=2, env={"MEGAGSPO_HARNESS_PROBE": "2"}):
        assert report["ppid"] == os.getpid() and report["probe"] == "2", report


def _printing_body(rank, world_size):
    import sys

    print(f"stdout of rank {rank}", flush=True)
    print(f"stderr of rank {rank}", file=sys.stderr, flush=True)
    return rank


@pytest.mark.multiprocess
def test_child_output_reaches_the_running_test(capfd):
    """A forked child writes to this process's stdout / stderr as they are now (here capfd's), not to those the
    fork server started with."""
    assert run_distributed(_printing_body, world_size=2) == [0, 1]
    out, err = capfd.readouterr()
    assert "stdout of rank 0" in out and "stdout of rank 1" in out, out
    assert "stderr of rank 0" in err and "stderr of rank 1" in err, err


def _dying_body(rank, world_size):
    import os

    if rank == 1:
        os._exit(3)
    return rank


@pytest.mark.multiprocess
def test_a_rank_that_dies_without_a_result_is_named_with_its_exit_code():
    with pytest.raises(DistributedTestError, match=r"ranks died without a result, exit codes \{1: 3\}"):
        run_distributed(_dying_body, world_size=2, timeout_s=60)
