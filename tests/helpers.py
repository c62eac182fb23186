"""Helpers the test modules share (one copy each): the repository root, fresh seeds, the scaled closeness
check, the tiny architectures and the tiny trainer.

Plain functions, not pytest fixtures: most model tests build their model inside a spawned child
(tests/multiprocess.run_distributed), which imports this module but where no fixture reaches. What runs inside
such a child with Megatron's groups (the CPU shim, the groups, Megatron's RNG) is in tests/devices.py."""

from __future__ import annotations

import os
from typing import Callable

import torch

from moe.architecture import Qwen3MoeArchitecture

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_RECIPE = os.path.join(REPO, "configs/tiny_cpu.yaml")


def fresh_seed() -> int:
    """A fresh seed per test, printed; MEGAGSPO_TEST_SEED=N reruns a failure's seed."""
    seed = int(os.environ.get("MEGAGSPO_TEST_SEED") or torch.randint(0, 2**20, ()).item())
    print(f"seed {seed}")
    return seed


def reseed_torch() -> int:
    """torch's global generator seeded with a fresh seed in [0, 2**31 - 1), returned for failure messages."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    torch.manual_seed(seed)
    return seed


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, what: str, *, rtol: float, atol_scale: float,
                        atol_floor: float = 1e-7) -> None:
    """torch.testing.assert_close with an absolute tolerance relative to the reference's largest value
    (atol = atol_scale * max|expected| + atol_floor): float reductions in another order differ by a few ulps
    of the largest value, not of each element. `what` starts the failure message."""
    atol = atol_scale * float(expected.abs().max()) + atol_floor
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def scaled_close(*, rtol: float, atol_scale: float, atol_floor: float = 1e-7) -> Callable[..., None]:
    """assert_close_scaled with a module's tolerances fixed: `_close = scaled_close(rtol=1e-5, atol_scale=2e-6)`,
    then `_close(actual, expected, what)`."""
    def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
        assert_close_scaled(actual, expected, what, rtol=rtol, atol_scale=atol_scale, atol_floor=atol_floor)
    return close


# The tiny Qwen3-MoE shapes the tests build, by name; a test passes the sizes it needs different as overrides of
# tiny_arch (every field not named keeps Qwen3MoeArchitecture's default, e.g. max_position_embeddings=40960).
TINY_ARCHS = {
    # two MoE layers of 4 experts, top-2, GQA 4 / 2 heads of 8: the Megatron model of most layout tests
    "moe": dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                max_position_embeddings=64),
    # the same with layer 0 dense (a SwiGLU MLP 24 wide, TP-split gate / up): the mixed models Qwen3 allows
    "mixed": dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                  max_position_embeddings=64, mlp_only_layers=(0,), intermediate_size=24),
    # one layer, hidden 16, 4 experts: the fastest to build (optimizer and precision tests)
    "micro": dict(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=8, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
                  max_position_embeddings=16),
    # one layer around an attention module tested alone (heads, kv heads and head_dim overridden per test)
    "attention": dict(vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=2,
                      num_experts_per_tok=2),
    # the planner's arithmetic checked by hand: every size small and most of them distinct
    "planner": dict(vocab_size=100, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=4, moe_intermediate_size=6, num_experts=4, num_experts_per_tok=2),
}


def tiny_arch(name: str = "moe", **overrides) -> Qwen3MoeArchitecture:
    """The tiny architecture `name` of TINY_ARCHS with `overrides` (field=value) applied, validated."""
    if name not in TINY_ARCHS:
        raise KeyError(f"no tiny architecture {name!r}; known: {', '.join(TINY_ARCHS)}")
    return Qwen3MoeArchitecture(**{**TINY_ARCHS[name], **overrides})


def tiny_trainer(overrides, **trainer_kwargs):
    """A Trainer of configs/tiny_cpu.yaml with `overrides` (key=value strings), quiet; `trainer_kwargs` go to
    Trainer (reward_fn=, adamw_class=, ...). Imported here, not at the top: the Trainer loads Megatron-Core and
    transformers (seconds), which the tests that only need REPO or a seed do not."""
    from megagspo.config import load_config
    from megagspo.trainer.trainer import Trainer

    return Trainer(load_config(TINY_RECIPE, overrides), quiet=True, **trainer_kwargs)
