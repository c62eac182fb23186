"""The fused-kernel extension itself: loaded, complete, and its fallback reason readable.

Not skipped: without megagspo._C every other tests/test_kernel_*.py test skips, and that must not look green.
"""

import torch

import megagspo.kernels as K
from megagspo.kernels._ops import OPS


def test_extension_loaded_with_every_op():
    assert K.extension_error() is None, f"megagspo._C is not usable: {K.extension_error()}"
    assert K.fused_available("cpu")
    for name in OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"megagspo::{name}", "CPU"), name


def test_cuda_kernels_present_when_built_with_cuda():
    from megagspo import _C

    assert K.fused_available("cuda") == (_C.built_with_cuda() and torch.version.cuda is not None)


_NO_EXTENSION_SCRIPT = r"""
import sys, warnings
sys.modules["megagspo._C"] = None  # makes `from megagspo import _C` raise ImportError
import torch
import megagspo.kernels as K
assert not K.fused_available("cpu") and "could not be imported" in K.extension_error()
x = torch.randn(4, 11, requires_grad=True)
y = torch.randint(0, 11, (4,))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    lp = K.token_logprobs(x, y)
    lp.sum().backward()
    K.token_logprobs(x, y)
    h, w = torch.randn(4, 3, requires_grad=True), torch.randn(11, 3, requires_grad=True)
    K.linear_token_logprobs(h, w, y, chunk_size=2).sum().backward()
    cu = torch.tensor([0, 1, 4])
    loss, _ = K.gspo_segment_loss(lp.detach().requires_grad_(), lp.detach() - 1e-4, torch.ones(4, dtype=torch.bool),
                                  cu, torch.tensor([1.0, -1.0]), num_global_sequences=2)
msgs = [str(m.message) for m in caught if issubclass(m.category, RuntimeWarning)]
assert len(msgs) == 1 and "falling back to the pure-torch reference" in msgs[0], msgs
try:
    K.token_logprobs(x, y, impl="fused")
except RuntimeError as exc:
    assert "impl='fused' requested" in str(exc)
else:
    raise AssertionError("impl='fused' without the extension must raise")
print("OK")
"""


def test_fallback_without_extension_warns_once():
    """A process in which megagspo._C cannot be imported: every entry point runs on the reference, with
    exactly one warning naming the reason, and impl='fused' fails loudly."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", _NO_EXTENSION_SCRIPT], capture_output=True, text=True, cwd=root,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stdout + out.stderr
