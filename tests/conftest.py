"""Suite-wide pytest rules: GPU tests skip with a reason without CUDA; an empty collection fails."""

import pytest
import torch


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
