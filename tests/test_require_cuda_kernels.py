"""MEGAGSPO_REQUIRE_CUDA_KERNELS=1 (set by tools/gpu_check.sh) turns a kernel test's 'built without CUDA kernels' /
'megagspo._C not built' skip into a failure, so that a CPU-only build of the extension cannot look green on a GPU
host; other skips stay skips, and without the switch nothing changes."""

from __future__ import annotations

import os

import pytest

pytest_plugins = ["pytester"]

BODY = '''
import pytest

def test_kernel():
    pytest.skip("megagspo._C built without CUDA kernels")

@pytest.mark.skipif(True, reason="megagspo._C not built (make ext)")
def test_module_level_reason():
    pass

def test_other_skip():
    pytest.skip("needs sglang")
'''


@pytest.fixture
def suite(pytester):
    with open(os.path.join(os.path.dirname(__file__), "conftest.py")) as f:
        pytester.makeconftest(f.read())
    pytester.makepyfile(test_body=BODY)
    return pytester


def test_missing_kernels_fail_when_required(suite, monkeypatch):
    monkeypatch.setenv("MEGAGSPO_REQUIRE_CUDA_KERNELS", "1")
    result = suite.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1, errors=1, skipped=1)  # a skip at set-up (skipif) fails as an error
    result.stdout.fnmatch_lines(["*MEGAGSPO_REQUIRE_CUDA_KERNELS=1 but this test was skipped*"])


def test_missing_kernels_skip_by_default(suite, monkeypatch):
    monkeypatch.delenv("MEGAGSPO_REQUIRE_CUDA_KERNELS", raising=False)
    suite.runpytest("-p", "no:cacheprovider").assert_outcomes(skipped=3)
