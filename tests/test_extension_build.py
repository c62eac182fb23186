"""The csrc/ extension is built by the install and importable; its CUDA flag matches this torch."""

import torch


def test_extension_imports_and_reports_its_cuda_build():
    import megagspo._C as ext

    built_with_cuda = ext.built_with_cuda()
    assert isinstance(built_with_cuda, bool)
    if torch.version.cuda is None:
        assert built_with_cuda is False
