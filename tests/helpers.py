"""Helpers the test modules share (one copy each): the repository root and a fresh, printed seed."""

from __future__ import annotations

import os

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fresh_seed() -> int:
    """A fresh seed per test, printed; MEGAGSPO_TEST_SEED=N reruns a failure's seed."""
    seed = int(os.environ.get("MEGAGSPO_TEST_SEED") or torch.randint(0, 2**20, ()).item())
    print(f"seed {seed}")
    return seed


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, what: str, *, rtol: float, atol_scale: float,
                        atol_floor: float = 1e-7) -> None:
    """torch.testing.assert_close with an absolute tolerance relative to the reference's largest value
    (atol = atol_scale * max|expected| + atol_floor): float reductions in another order differ by a few ulps
    of the largest value, not of each element. `what` starts the failure message."""
    atol = atol_scale * float(expected.abs().max()) + atol_floor
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")
