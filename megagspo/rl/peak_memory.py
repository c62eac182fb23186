"""The memory/ metrics: a process's peak memory over one window of work (the trainer over one RL step, the rollout
producer over one batch it makes), so a run shows step by step how close each process came to its device's capacity.
With `rollout.staleness` >= 1 in a producer process, the trainer and the producer hold a model each, on one GPU
when the trainer has one: both peaks are logged (`memory/trainer_peak_gib`, `memory/producer_peak_gib`).

What is measured, per device:
- CUDA: the caching allocator's peak reserved bytes on the process's GPU (`torch.cuda.max_memory_reserved`, its
  counters reset when a window starts). Reserved, not allocated: what the process holds from the device and no other
  process can use. The CUDA context (~0.5 GiB per process) is outside both.
- CPU: the process's peak resident set (VmHWM in /proc/self/status), reset when a window starts by writing 5 to
  /proc/self/clear_refs (Linux). Where that file cannot be written, the peak since the process started
  (getrusage), and the window's peak is then an upper bound.
Values differ from run to run (allocator caching, the kernel's page accounting): like time/, the memory/ entries
are not part of a run's deterministic record (a resumed run's rows equal the uninterrupted run's but for them).
"""

from __future__ import annotations

import re
import resource

import torch

from moe import cuda_calls

GIB = float(1 << 30)
_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"
_RESET_PEAK_RSS = "5"  # proc(5): "5" resets the peak resident set size ("high water mark") to the current RSS


class PeakMemory:
    """One process's peak memory on `device` over windows: `start()` opens one, `peak_gib()` reads its peak so far."""

    def __init__(self, device) -> None:
        self.device = torch.device(device)

    def start(self) -> None:
        if self.device.type == "cuda":
            cuda_calls.reset_peak_memory(self.device)
        else:
            _reset_peak_rss()

    def peak_gib(self) -> float:
        if self.device.type == "cuda":
            return cuda_calls.max_memory_reserved(self.device) / GIB
        return _peak_rss_bytes() / GIB


def _reset_peak_rss() -> None:
    try:
        with open(_CLEAR_REFS, "w") as fh:
            fh.write(_RESET_PEAK_RSS)
    except OSError:
        pass  # not Linux, or not permitted: the peak since the process started stands (see the module docstring)


def _peak_rss_bytes() -> int:
    try:
        with open(_STATUS) as fh:
            found = re.search(r"^VmHWM:\s+(\d+)\s+kB", fh.read(), re.MULTILINE)
        if found:
            return int(found.group(1)) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports kB
