"""Group advantages (eq. 7)."""

from __future__ import annotations

import pytest
import torch

from megagspo.algorithm import GroupAdvantageConfig, group_advantages
from test_algo_common import F64, assert_close64, gen  # noqa: F401


@pytest.mark.parametrize("scale_by_std", [True, False])
@pytest.mark.parametrize("unbiased", [True, False])
def test_matches_eq7_per_group(gen, scale_by_std, unbiased):
    B, G = int(torch.randint(1, 9, (1,), generator=gen)), int(torch.randint(2, 17, (1,), generator=gen))
    rewards = torch.rand(B, G, generator=gen, dtype=F64)
    adv = group_advantages(rewards, scale_by_std=scale_by_std, unbiased_std=unbiased, eps=1e-6)
    for b in range(B):
        r = rewards[b].tolist()
        mean = sum(r) / G
        var = sum((x - mean) ** 2 for x in r) / (G - 1 if unbiased else G)
        expected = torch.tensor([(x - mean) / ((var ** 0.5 + 1e-6) if scale_by_std else 1.0) for x in r], dtype=F64)
        assert_close64(adv[b], expected)
    # The flat layout with group_size is the same computation.
    assert torch.equal(group_advantages(rewards.reshape(-1), group_size=G, scale_by_std=scale_by_std,
                                        unbiased_std=unbiased), adv.reshape(-1))


def test_equal_reward_groups_give_exact_zeros_never_nan(gen):
    G = 3
    # 0.1 * 3 / 3 != 0.1 in floating point: a naive (r - mean) / (std + eps) would give ~1e-11, not 0.
    flat = torch.tensor([0.1] * G + [7.3] * G + [0.0] * G, dtype=F64)
    mixed = torch.rand(G, generator=gen, dtype=F64)
    rewards = torch.cat([flat, mixed])
    for scale in (True, False):
        adv = group_advantages(rewards, group_size=G, scale_by_std=scale, eps=0.0)
        assert torch.equal(adv[: 3 * G], torch.zeros(3 * G, dtype=F64))
        assert bool(torch.isfinite(adv).all()) and bool((adv[3 * G:] != 0).any())


def test_float32_and_integer_rewards(gen):
    r32 = torch.rand(4, 5, generator=gen)
    assert_close64(group_advantages(r32), group_advantages(r32.double()), rtol=1e-5, atol=1e-6)
    ints = torch.randint(0, 2, (6, 4), generator=gen)
    adv = group_advantages(ints)
    assert adv.is_floating_point() and bool(torch.isfinite(adv).all())


def test_errors():
    with pytest.raises(ValueError, match=r"group size G=1.*configuration error"):
        group_advantages(torch.rand(5, 1))
    with pytest.raises(ValueError, match=r"group size G=1"):
        group_advantages(torch.rand(5), group_size=1)
    with pytest.raises(ValueError, match=r"need group_size"):
        group_advantages(torch.rand(6))
    with pytest.raises(ValueError, match=r"length 7 are not a whole number of groups of size 2"):
        group_advantages(torch.rand(7), group_size=2)
    with pytest.raises(ValueError, match=r"group_size=3 but rewards_BG has shape \(2, 4\)"):
        group_advantages(torch.rand(2, 4), group_size=3)
    bad = torch.rand(4, 3)
    bad[2, 1] = float("nan")
    bad[3, 0] = float("inf")
    with pytest.raises(ValueError, match=r"2 NaN/inf value\(s\), in group\(s\) \[2, 3\] of 4"):
        group_advantages(bad)
    with pytest.raises(ValueError, match=r"GroupAdvantageConfig.eps must be a finite number >= 0, got -1"):
        GroupAdvantageConfig(eps=-1)
