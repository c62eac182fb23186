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
