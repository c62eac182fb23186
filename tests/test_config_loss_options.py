"""One config surface: every loss option reaches the algorithm from YAML and the command line through
megagspo.kernels.policy_losses.build_loss (the rl sections are the loss Config's parts, and the flat keys of
earlier recipes still reach the same fields), one spelling per concept, replay flags derived from
rl.routing_replay, and rl.loss.impl / rl.logprob_impl = kernels that really force the fused kernels.

Legend: B rows (sequences), L positions per row.
"""

from __future__ import annotations

import dataclasses
import glob

import pytest
import torch

from megagspo.algorithm import PackedBatch, get_loss, group_advantages, segment_ids
from megagspo.algorithm.advantages import GroupAdvantageConfig
from megagspo.algorithm.losses import GRPOConfig, GSPOConfig, grpo_loss
from megagspo.algorithm.kl import KLConfig
from megagspo.algorithm.old_policy import OldPolicyConfig
from megagspo.algorithm.registry import LossOptionError, available_losses, config_paths, loss_option_keys
from megagspo.config import (ConfigError, RLConfig, RLLossConfig, config_from_dict, deferred_path_checks,
                             load_config)
from megagspo.kernels.policy_losses import build_loss

TINY = "configs/tiny_cpu.yaml"


def _tiny(*overrides):
    return load_config(TINY, list(overrides))


def _hand_translation(rl):
    """What Trainer.__init__ built before build_loss existed (trainer.py at ff9db87): the reference the
    builder must reproduce for every existing recipe, so their runs are unchanged."""
    fields = dict(clip_low=rl.loss.clip_low, clip_high=rl.loss.clip_high, old_policy={"source": rl.old_policy.source})
    if rl.kl.coef > 0:
        fields["kl"] = {"coef": rl.kl.coef, "estimator": "k3"}
    return get_loss(rl.loss.name), get_loss(rl.loss.name).Config(**fields)


# ------------------------------------------------------------------------------------ coverage, unchanged runs


def test_every_field_of_every_loss_config_has_an_rl_key():
    """The loss Configs' parts are sections as they are (rl.kl is a KLConfig, rl.old_policy an OldPolicyConfig,
    rl.advantage eq. 7's GroupAdvantageConfig); the loss's own fields are rl.loss's under the same names."""
    sections = {f.name: f for f in dataclasses.fields(RLConfig)}
    defaults = RLConfig()
    assert type(defaults.kl) is KLConfig and type(defaults.old_policy) is OldPolicyConfig
    assert type(defaults.advantage) is GroupAdvantageConfig
    reachable = {f.name for f in dataclasses.fields(RLLossConfig)}
    reachable |= {f"kl.{k}" for k in config_paths(KLConfig)} | {f"old_policy.{k}" for k in config_paths(OldPolicyConfig)}
    for name in available_losses():
        missing = set(config_paths(get_loss(name).Config)) - reachable
        assert not missing, f"loss {name!r}: Config fields {missing} cannot be set from YAML"
    assert {"batch", "loss", "kl", "old_policy", "advantage", "filter", "optim", "eval"} <= set(sections)


@pytest.mark.parametrize("recipe", sorted(glob.glob("configs/*.yaml")))
def test_every_recipe_builds_the_loss_the_hand_translation_built(recipe):
    with deferred_path_checks():
        cfg = load_config(recipe)
    loss_fn, loss_cfg = build_loss(cfg.rl)
    ref_fn, ref_cfg = _hand_translation(cfg.rl)
    assert loss_fn is ref_fn and loss_cfg == ref_cfg
    assert cfg.rl.advantage == GroupAdvantageConfig(scale_by_std=cfg.rl.advantage.scale_by_std)


def test_tiny_recipe_loss_is_gspo_at_its_clip_range():
    loss_fn, loss_cfg = build_loss(_tiny().rl)
    assert loss_fn is get_loss("gspo")
    assert loss_cfg == GSPOConfig(clip_low=0.003, clip_high=0.004)


# ------------------------------------------------------------------------------------ options reach the loss


GRPO_OPTIONS = {  # the sections' paths, and the flat keys of earlier recipes for the same values
    "new": ["rl.loss.name=grpo", "rl.loss.clip_low=0.2", "rl.loss.clip_high=0.27", "rl.loss.dual_clip=3",
            "rl.loss.aggregation=token_mean", "rl.kl.coef=0.01", "rl.kl.estimator=k1",
            "rl.old_policy.correction.method=true", "rl.old_policy.correction.cap=1.5", "rl.loss.validate=false"],
    "flat": ["rl.loss=grpo", "rl.clip_low=0.2", "rl.clip_high=0.27", "rl.dual_clip=3", "rl.aggregation=token_mean",
             "rl.kl_coef=0.01", "rl.kl_estimator=k1", "rl.rollout_correction=true", "rl.rollout_correction_cap=1.5",
             "rl.loss_input_checks=false"],
}


@pytest.mark.parametrize("spelling", sorted(GRPO_OPTIONS))
def test_every_grpo_option_reaches_its_config_from_the_command_line(spelling):
    cfg = _tiny(*GRPO_OPTIONS[spelling])
    loss_fn, c = build_loss(cfg.rl)
    assert loss_fn is get_loss("grpo") and isinstance(c, GRPOConfig)
    assert (c.clip_low, c.clip_high, c.dual_clip, c.aggregation) == (0.2, 0.27, 3.0, "token_mean")
    assert (c.kl.coef, c.kl.estimator) == (0.01, "k1")
    # `true` of earlier recipes is seq_tis, the one correction there was
    assert (c.old_policy.source, c.old_policy.correction.method, c.old_policy.correction.cap) == \
        ("recompute", "seq_tis", 1.5)
    assert c.validate is False


def test_options_reach_the_config_from_yaml():
    cfg = config_from_dict({"rl": {"loss": {"name": "gspo_token"}, "kl": {"coef": 0.05, "estimator": "k1"},
                                   "old_policy": {"source": "rollout"},
                                   "advantage": {"eps": 1e-4, "unbiased_std": False, "scale_by_std": False}}})
    _, c = build_loss(cfg.rl)
    assert (c.kl.coef, c.kl.estimator, c.old_policy.source) == (0.05, "k1", "rollout")
    assert cfg.rl.advantage == GroupAdvantageConfig(scale_by_std=False, eps=1e-4, unbiased_std=False)


def test_built_grpo_loss_computes_what_its_options_say():
    """dual_clip and token_mean change the loss: the built loss equals the functional GRPO with those options
    and differs from the default aggregation (so the option is not silently dropped on the way)."""
    gen = torch.Generator().manual_seed(0)
    B, L = 6, 9
    logp = -torch.rand(B, L, generator=gen, dtype=torch.float64) * 2
    old = logp + (torch.rand(B, L, generator=gen, dtype=torch.float64) - 0.5) * 3.0  # ratios far outside [0.8, 1.27]
    mask = torch.rand(B, L, generator=gen) < 0.6
    mask[:, 0] = True
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    batch = PackedBatch.from_padded(logp_BL=logp, loss_mask_BL=mask, num_global_sequences=B, old_logp_BL=old,
                                    advantages_B=adv, num_global_tokens=float(mask.sum()))
    cfg = _tiny("rl.loss=grpo", "rl.clip_low=0.2", "rl.clip_high=0.27", "rl.dual_clip=1.5", "rl.aggregation=token_mean")
    loss_fn, loss_cfg = build_loss(cfg.rl)
    got, _ = loss_fn(batch, loss_cfg)
    want, _ = grpo_loss(batch.logp_T, batch.old_logp_T, batch.loss_mask_T, batch.cu_seqlens_S1,
                        adv[segment_ids(batch.cu_seqlens_S1, batch.num_tokens)], clip_low=0.2, clip_high=0.27, dual_clip=1.5,
                        aggregation="token_mean", num_global_tokens=float(mask.sum()))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    default_fn, default_cfg = build_loss(_tiny("rl.loss=grpo", "rl.clip_low=0.2", "rl.clip_high=0.27").rl)
    assert not torch.allclose(default_fn(batch, default_cfg)[0], got)


def test_advantage_options_reach_group_advantages():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    adv_cfg = _tiny("rl.advantage.eps=0.5", "rl.advantage.unbiased_std=false").rl.advantage
    got = group_advantages(rewards, **dataclasses.asdict(adv_cfg))
    centered = rewards - rewards.mean(1, keepdim=True)
    torch.testing.assert_close(got, centered / (rewards.std(1, keepdim=True, unbiased=False) + 0.5))


# ------------------------------------------------------------------------------------ errors name the key


@pytest.mark.parametrize("overrides, words", [
    (["rl.loss.dual_clip=3"], ["rl.loss.dual_clip = 3", "rl.loss.name = grpo only",
                               "'gspo' takes: rl.loss.clip_low, rl.loss.clip_high, rl.loss.validate"]),
    (["rl.dual_clip=3"], ["rl.loss.dual_clip = 3", "grpo only"]),  # a flat key of earlier recipes: its new name
    (["rl.loss.aggregation=token_mean"], ["rl.loss.aggregation", "grpo only"]),
    (["rl.loss.name=grpo", "rl.loss.aggregation=seq_mean"], ["rl.loss.aggregation", "seq_mean_token_mean", "token_mean"]),
    (["rl.loss.name=grpo", "rl.loss.dual_clip=0.5"], ["rl.loss.dual_clip", "0.5"]),
    (["rl.kl.estimator=k2"], ["rl.kl.estimator", "k1", "k3"]),
    (["rl.kl_estimator=k2"], ["rl.kl.estimator", "k1", "k3"]),
    (["rl.old_policy.source=rollout", "rl.old_policy.correction.method=true"],
     ["rl.old_policy.correction.method", "needs source='recompute'"]),
    (["rl.old_policy.correction.cap=0.5"], ["rl.old_policy.correction.cap must be a finite number >= 1"]),
    (["rl.advantage.eps=-1"], ["rl.advantage.eps must be a finite number >= 0"]),
    (["rl.old_policy.correction.method=1"], ["rl.old_policy.correction.method must be a string"]),
    (["rl.old_policy.correction.method=icepop"], ["rl.old_policy.correction.method must be one of", "token_mask", "opsm"]),
    (["rl.old_policy.correction.token_mask_low=2"], ["rl.old_policy.correction.token_mask_low must be <= 1"]),
    (["rl.old_policy.correction.token_mask_high=0.5"],
     ["rl.old_policy.correction.token_mask_high must be a finite number >= 1"]),
    (["rl.loss.impl=kernels", "rl.old_policy.correction.method=opsm"], ["rl.loss.impl = 'kernels'", "per-sequence weights"]),
    (["rl.loss.name=grpo", "rl.loss.impl=kernels"], ["rl.loss.impl = 'kernels'", "rl.loss.name = 'grpo'", "gspo, gspo_token"]),
    (["rl.loss.impl=kernels", "rl.old_policy.correction.method=true"],
     ["rl.loss.impl = 'kernels'", "rl.old_policy.correction.method"]),
    (["rl.loss.dual_clipp=3"], ["unknown config key 'rl.loss.dual_clipp'", "dual_clip", "aggregation", "validate"]),
    (["rl.optim.lr=2"], ["rl.optim.lr must be a finite number in (0.0, 1.0]"]),
    (["sft.optim.schedule=step"], ["sft.optim.schedule = 'step' is not valid", "cosine"]),
])
def test_a_bad_loss_option_is_refused_naming_the_key(overrides, words):
    from megagspo.trainer.preflight import check_components

    with pytest.raises(ConfigError) as err:  # on load, or (the fused kernel's reach) in every run's preflight
        check_components(_tiny(*overrides))
    for w in words:
        assert w in str(err.value), f"{w!r} not in {err.value}"


def test_build_loss_refuses_on_its_own_without_the_config_loader():
    rl = dataclasses.replace(RLConfig(), loss=RLLossConfig(name="grpo", clip_low=0.2, clip_high=0.27))
    object.__setattr__(rl.loss, "aggregation", "sum")  # past RLLossConfig's checks, as a hand-built config could be
    with pytest.raises(LossOptionError, match=r"rl\.loss\.aggregation must be one of"):
        build_loss(rl)
    assert loss_option_keys("gspo") == ["clip_low", "clip_high", "validate"]
    assert loss_option_keys("grpo") == ["clip_low", "clip_high", "dual_clip", "aggregation", "validate"]


# ------------------------------------------------------------------------------------ one spelling per concept


@pytest.mark.parametrize("override, right", [
    ("rl.routing_replay=off", "'none'"),        # YAML reads a bare off as false
    ('rl.routing_replay="off"', "'none'"),      # SGLang's spelling
    ("rl.loss_impl=fused", "'kernels'"),
    ("rl.logprob_impl=fused", "'kernels'"),
])
def test_another_spelling_is_a_clear_error(override, right):
    with pytest.raises(ConfigError, match=f"is spelled {right} here; valid values"):
        _tiny(override)


# ------------------------------------------------------------------------------------ replay flags derived


def test_engine_routes_follow_routing_replay_and_old_logp():
    assert _tiny().rollout.record_routes is False  # nothing reads them: the engine is not asked
    assert _tiny("rl.routing_replay=r2").rollout.record_routes is False  # R2 records in the pi_old forward
    assert _tiny("rl.routing_replay=r3").rollout.record_routes is True
    assert _tiny("rl.old_logp=rollout").rollout.record_routes is True  # pi_old's routes for expert volatility
    assert _tiny("rl.routing_replay=r3", "rollout.record_routes=true").rollout.record_routes is True  # redundant: ok
    with pytest.raises(ConfigError, match=r"rollout.record_routes = False contradicts rl.routing_replay = 'r3'"):
        _tiny("rl.routing_replay=r3", "rollout.record_routes=false")
    cfg = _tiny("rl.routing_replay=r3")  # a run's saved config.yaml loads back to the same config
    assert config_from_dict(cfg.to_dict()).rollout == cfg.rollout


def test_sglang_replay_mode_follows_routing_replay():
    from megagspo.rollout.sglang import SGLangEngineConfig

    sglang = ["rollout.engine=sglang", "rollout.sglang={urls: [http://127.0.0.1:30000], sync_dir: /tmp/w}"]
    assert _tiny(*sglang).rollout.sglang["routing_replay"] == "off"
    cfg = _tiny(*sglang, "rl.routing_replay=r3")
    assert SGLangEngineConfig(**cfg.rollout.sglang).routing_replay == "r3" and cfg.rollout.record_routes
    with pytest.raises(ConfigError, match=r"rollout.sglang.routing_replay = 'off' contradicts rl.routing_replay = 'r3'"):
        _tiny(*sglang[:1], "rollout.sglang={urls: [http://h:1], sync_dir: /tmp/w, routing_replay: 'off'}",
              "rl.routing_replay=r3")


# ------------------------------------------------------------------------------------ kernels are forced


def _gspo_batch():
    gen = torch.Generator().manual_seed(1)
    logp = -torch.rand(4, 5, generator=gen)
    return PackedBatch.from_padded(logp_BL=logp, loss_mask_BL=torch.ones(4, 5, dtype=torch.bool),
                                   num_global_sequences=4, old_logp_BL=logp + 0.01, advantages_B=torch.randn(4, generator=gen))


def test_loss_impl_kernels_runs_the_fused_kernel_and_equals_the_torch_loss():
    import megagspo.kernels as kernels

    if not kernels.fused_available("cpu"):
        pytest.skip("megagspo._C has no CPU kernels in this build")
    fused_fn, cfg = build_loss(_tiny("rl.loss_impl=kernels").rl)
    torch_fn, torch_cfg = build_loss(_tiny().rl)
    assert fused_fn is not torch_fn and cfg == torch_cfg
    batch = _gspo_batch()
    torch.testing.assert_close(fused_fn(batch, cfg)[0], torch_fn(batch, cfg)[0], rtol=1e-5, atol=1e-6)


def test_loss_impl_kernels_raises_instead_of_falling_back(monkeypatch):
    import megagspo.kernels as kernels

    fused_fn, cfg = build_loss(_tiny("rl.loss_impl=kernels").rl)
    monkeypatch.setattr(kernels, "has_device_kernel", lambda device: False)  # as on a box whose _C lacks them
    with pytest.raises(RuntimeError, match="impl='fused' requested"):
        fused_fn(_gspo_batch(), cfg)


def test_logprob_impl_kernels_raises_instead_of_falling_back(monkeypatch):
    import megagspo.kernels as kernels
    from megagspo.policy.megatron_policy import _logprob_fn

    monkeypatch.setattr(kernels, "has_device_kernel", lambda device: False)
    logits, target = torch.randn(3, 7), torch.tensor([0, 4, 6])
    with pytest.raises(RuntimeError, match="impl='fused' requested"):
        _logprob_fn("kernels")(logits, target)
    with pytest.warns(RuntimeWarning, match="falling back"):  # auto is the one that may fall back, loudly
        _logprob_fn("auto")(logits, target)


# ------------------------------------------------------------------------------------ ablation arms


def test_an_ablation_arm_may_vary_any_loss_option_and_a_wrong_one_names_the_arm(tmp_path):
    import os

    from megagspo.ablation.spec import load_ablation

    recipe = tmp_path / "ab.yaml"
    base = os.path.abspath(TINY)
    recipe.write_text(f"name: ab\nbase: {base}\ncommon: {{rl.steps: 1}}\narms:\n"
                      "  grpo_dual: {rl.loss: grpo, rl.clip_low: 0.2, rl.clip_high: 0.27, rl.dual_clip: 3,\n"
                      "              rl.aggregation: token_mean, rl.kl_estimator: k1}\n"
                      "  gspo_dual: {rl.loss: gspo, rl.dual_clip: 3}\n")
    spec = load_ablation(str(recipe), out_dir=str(tmp_path / "out"), arms=["grpo_dual"])
    _, c = build_loss(spec.validate_runs([])["grpo_dual"].rl)
    assert (c.dual_clip, c.aggregation, c.kl.estimator) == (3.0, "token_mean", "k1")
    spec = load_ablation(str(recipe), out_dir=str(tmp_path / "out"))
    with pytest.raises(ConfigError, match=r"ablation arm 'gspo_dual': rl.loss.dual_clip = 3.0 applies to rl.loss.name = "
                                          r"grpo only"):
        spec.validate_runs([])


def test_an_ablation_folder_written_before_the_derivation_is_the_same_run(tmp_path):
    """A cell folder whose config.yaml holds the old default rollout.record_routes = true (before it followed
    rl.routing_replay) resumes instead of being refused as a different config."""
    import os

    import yaml

    from megagspo.ablation.runner import expected_config, plan_runs, run_state
    from megagspo.ablation.spec import load_ablation

    recipe = tmp_path / "ab.yaml"
    recipe.write_text(f"name: ab\nbase: {os.path.abspath(TINY)}\ncold_start: sft\narms:\n  gspo: {{rl.loss: gspo}}\n")
    spec = load_ablation(str(recipe), out_dir=str(tmp_path / "out"))
    cell = [r for r in plan_runs(spec, []) if r.kind == "cell"][0]
    saved = expected_config(spec, cell, [])
    assert saved["rollout"]["record_routes"] is False
    saved["rollout"]["record_routes"] = True
    # keys a folder written before they existed lacks: they ran at their defaults
    del saved["rl"]["loss"]["dual_clip"], saved["rl"]["kl"]["estimator"], saved["rl"]["advantage"]["eps"]
    os.makedirs(cell.run_dir)
    with open(os.path.join(cell.run_dir, "config.yaml"), "w") as f:
        yaml.safe_dump(saved, f)
    assert run_state(spec, cell, []) == "partial"
    saved["rl"]["loss"]["dual_clip"] = 2.0  # a real difference is still refused
    with open(os.path.join(cell.run_dir, "config.yaml"), "w") as f:
        yaml.safe_dump(saved, f)
    with pytest.raises(ConfigError, match="rl.loss.dual_clip: 2.0 there, None asked"):
        run_state(spec, cell, [])


def test_dry_run_prints_the_loss_build_loss_built():
    from megagspo.dry_run import _describe_loss

    text = _describe_loss(_tiny("rl.loss=grpo", "rl.clip_low=0.2", "rl.clip_high=0.27", "rl.dual_clip=3").rl)
    assert text.startswith("grpo (torch): clip_low=0.2, clip_high=0.27, dual_clip=3.0, aggregation=")
    assert "dual_clip" not in _describe_loss(_tiny().rl)  # gspo has no such option: not listed
    assert _describe_loss(_tiny("rl.loss_impl=kernels").rl).startswith("gspo (fused segmented GSPO kernel)")
