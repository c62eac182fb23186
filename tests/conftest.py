"""Suite-wide pytest rules: GPU tests skip with a reason without CUDA; an empty collection fails; with
MEGAGSPO_REQUIRE_CUDA_KERNELS=1 (tools/gpu_check.sh sets it) a test skipped because megagspo._C lacks its CUDA
kernels (or is not built) FAILS instead, so a CPU-only build of the extension cannot pass for a CUDA run."""

import os

import pytest
import torch

# the reasons the kernel tests give when the extension or its CUDA kernels are missing
MISSING_KERNEL_REASONS = ("built without CUDA kernels", "megagspo._C not built")


def require_cuda_kernels() -> bool:
    return os.environ.get("MEGAGSPO_REQUIRE_CUDA_KERNELS", "").strip() == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and require_cuda_kernels()):
        return
    reason = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)
    if any(r in reason for r in MISSING_KERNEL_REASONS):
        report.outcome = "failed"
        report.longrepr = (f"MEGAGSPO_REQUIRE_CUDA_KERNELS=1 but this test was skipped: {reason}. Build the "
                           "extension with MEGAGSPO_CUDA=1 (tools/gpu_check.sh does) and check "
                           "megagspo._C.built_with_cuda().")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA; this host has none (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_sessionfinish(session, exitstatus):
    # pytest already exits 5 on an empty collection; make the cause unmissable in CI logs as well.
    if session.testscollected == 0 and not session.config.option.collectonly:
        print("\nERROR: no tests were collected — a test run that tests nothing must not pass")
        session.exitstatus = 5
