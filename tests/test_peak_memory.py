"""The memory/ metrics' measurement (megagspo.rl.peak_memory): a window's peak sees what was allocated inside it and
forgets what came before it; on CUDA it reads the caching allocator of the process's GPU."""

from __future__ import annotations

import pytest
import torch

from megagspo.rl import peak_memory
from megagspo.rl.peak_memory import GIB, PeakMemory
from moe import cuda_calls

MIB_256 = 256 << 20


def _touch(nbytes: int) -> bytearray:
    buffer = bytearray(nbytes)
    for i in range(0, nbytes, 4096):  # resident only once written
        buffer[i] = 1
    return buffer


def test_a_cpu_window_sees_an_allocation_inside_it_and_forgets_one_before_it():
    memory = PeakMemory("cpu")
    memory.start()
    base = memory.peak_gib()
    big = _touch(MIB_256)
    inside = memory.peak_gib()
    assert inside >= base + 0.9 * MIB_256 / GIB, (base, inside)
    del big
    memory.start()  # the 256 MiB are gone: a new window's peak is the resident set now
    after = memory.peak_gib()
    assert after < inside - 0.5 * MIB_256 / GIB, (inside, after)


def test_without_proc_files_the_peak_since_start_stands(monkeypatch, tmp_path):
    """Not Linux (or clear_refs refused): the window cannot be reset, and the peak since the process started (an
    upper bound of the window's) is what is read."""
    monkeypatch.setattr(peak_memory, "_CLEAR_REFS", str(tmp_path / "missing" / "clear_refs"))
    monkeypatch.setattr(peak_memory, "_STATUS", str(tmp_path / "missing" / "status"))
    memory = PeakMemory(torch.device("cpu"))
    memory.start()
    import resource

    assert memory.peak_gib() == resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


def test_a_cuda_window_resets_and_reads_the_caching_allocator_of_its_gpu():
    calls = []

    def stand_in(api_name, fn, args, kwargs):
        calls.append((api_name, args))
        return 3 * (1 << 30) if api_name == "torch.cuda.max_memory_reserved" else None

    with cuda_calls.intercept(stand_in):
        memory = PeakMemory(torch.device("cuda", 1))
        memory.start()
        assert memory.peak_gib() == 3.0
    assert calls == [("torch.cuda.reset_peak_memory_stats", (torch.device("cuda", 1),)),
                     ("torch.cuda.max_memory_reserved", (torch.device("cuda", 1),))]


@pytest.mark.gpu
def test_a_cuda_window_measures_a_real_allocation():
    memory = PeakMemory(torch.device("cuda", torch.cuda.current_device()))
    memory.start()
    x = torch.empty(MIB_256, dtype=torch.uint8, device="cuda")
    assert memory.peak_gib() >= MIB_256 / GIB
    del x
