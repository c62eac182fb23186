"""The csrc/ extension is built by the install and importable; its CUDA flag matches this torch."""

import os

import torch


def test_extension_imports_and_reports_its_cuda_build():
    import megagspo._C as ext

    built_with_cuda = ext.built_with_cuda()
    assert isinstance(built_with_cuda, bool)
    if torch.version.cuda is None:
        assert built_with_cuda is False
    if os.environ.get("MEGAGSPO_REQUIRE_CUDA_KERNELS", "").strip() == "1":  # tools/gpu_check.sh on a GPU host
        assert built_with_cuda, "MEGAGSPO_REQUIRE_CUDA_KERNELS=1 but megagspo._C was built without CUDA kernels"


def _runtime_check():
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    import extension_runtime

    return extension_runtime


def test_built_extension_uses_the_process_cxx_runtime():
    """megagspo._C must not carry its own copy of the C++ exception runtime: with one, a failing TORCH_CHECK
    inside it segfaulted the process on the GPU host (its $CXX linked libstdc++ statically) instead of raising."""
    import megagspo._C as ext

    assert _runtime_check().private_runtime_problem(ext.__file__) is None


def test_a_statically_linked_cxx_runtime_is_detected(tmp_path):
    """What setup.py refuses, on a real shared object built here with -static-libstdc++ (and not the same
    source linked normally)."""
    import shutil
    import subprocess

    import pytest

    check = _runtime_check()
    fake = "0000000000012340 T __cxa_throw@@CXXABI_1.3\n0000000000012350 T megagspo_op\n"
    assert "linked libstdc++ statically" in check.private_runtime_problem("x.so", nm_output=fake, compiler="g++-w")
    assert check.private_runtime_problem("x.so", nm_output="0000000000012350 T megagspo_op\n") is None
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no g++ on this host")
    src = tmp_path / "t.cpp"
    src.write_text('#include <stdexcept>\nextern "C" int f(int x) { if (x) throw std::runtime_error("x"); return 0; }\n')
    for flags, bad in ((["-static-libstdc++"], True), ([], False)):
        lib = tmp_path / f"t{len(flags)}.so"
        subprocess.run([cxx, "-shared", "-fPIC", *flags, str(src), "-o", str(lib)], check=True)
        problem = check.private_runtime_problem(str(lib))
        assert (problem is not None) == bad, (flags, problem)
