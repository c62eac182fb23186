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
