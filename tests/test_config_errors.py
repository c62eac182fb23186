"""Config: YAML + overrides map onto the dataclasses; bad keys and values fail naming the key (and the valid
keys), and batch layouts that do not divide fail before any compute."""

import os

import pytest

from megagspo.config import ConfigError, config_from_dict, load_config, parse_overrides
from megagspo.trainer.layout import check_layout


def test_recipe_loads_with_overrides():
    cfg = load_config("configs/tiny_cpu.yaml", ["rl.steps=7", "seed=3", "rl.loss.clip_high=1e-3", "model.init_from="])
    assert cfg.rl.steps == 7 and cfg.seed == 3 and cfg.rl.loss.clip_high == 1e-3
    assert cfg.rl.batch.mini_batches == 4 and cfg.rl.loss.name == "gspo"


def test_unknown_key_names_it_and_lists_valid_keys():
    with pytest.raises(ConfigError) as err:
        load_config("configs/tiny_cpu.yaml", ["rl.stepz=3"])
    msg = str(err.value)
    assert "rl.stepz" in msg and "did you mean rl.steps?" in msg and "batch" in msg
    with pytest.raises(ConfigError, match=r"unknown config key 'rl.batch.mini_batchez' \(did you mean "
                                          r"rl.batch.mini_batches\?\); valid keys in rl.batch: prompts_per_step, "
                                          "group_size, mini_batches"):
        load_config("configs/tiny_cpu.yaml", ["rl.batch.mini_batchez=3"])
    with pytest.raises(ConfigError, match="unknown config key 'modle'.*valid keys.*model"):
        config_from_dict({"modle": {}})


@pytest.mark.parametrize("override, needle", [
    ("rl.loss.name=ppo", "rl.loss.name = 'ppo' is not valid; valid values: gspo, gspo_token, grpo"),
    ("rl.loss=ppo", "rl.loss.name = 'ppo' is not valid"),  # the flat key of earlier recipes, under its new name
    ("rl.batch.group_size=1", "rl.batch.group_size"),
    ("rl.steps=-1", "rl.steps"),
    ("rl.loss.clip_low=0", "rl.loss.clip_low"),
    ("rl.batch=3", "rl.batch must be a mapping"),
    ("rl.routing_replay=r5", "rl.routing_replay"),
    ("data.task=file", "data.train_path is required"),
    ("data.tokenizer=/nonexistent/tok", "data.tokenizer"),
    ("model.init_from=/nonexistent/ckpt", "model.init_from"),
    ("log.progress=maybe", "log.progress must be true or false"),
])
def test_bad_values_name_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        load_config("configs/tiny_cpu.yaml", [override])


def test_mini_batches_must_divide_samples():
    with pytest.raises(ConfigError, match=r"do not divide into rl.batch.mini_batches = 3"):
        load_config("configs/tiny_cpu.yaml", ["rl.prompts_per_step=4", "rl.group_size=4", "rl.mini_batches=3"])


def test_batch_must_divide_over_ranks():
    cfg = load_config("configs/tiny_cpu.yaml", ["rl.prompts_per_step=5", "rl.group_size=4", "rl.mini_batches=4"])
    assert check_layout(cfg, 1).dp_size == 1
    with pytest.raises(ConfigError, match="rl.batch.prompts_per_step = 5 does not divide over 2 data-parallel ranks"):
        check_layout(cfg, 2)
    cfg = load_config("configs/tiny_cpu.yaml", ["rl.prompts_per_step=2", "rl.group_size=4", "rl.mini_batches=8"])
    with pytest.raises(ConfigError, match="do not divide into rl.batch.mini_batches = 8"):
        check_layout(cfg, 2)
    cfg = load_config("configs/tiny_cpu.yaml", ["parallel.expert_parallel=3"])
    with pytest.raises(ConfigError, match="expert_parallel"):
        check_layout(cfg, 3)
    # PP stages of one data-parallel rank share its batch: 4 ranks at PP=2 are 2 data-parallel ranks
    cfg = load_config("configs/tiny_cpu.yaml", ["parallel.pipeline_parallel=2", "rl.prompts_per_step=4",
                                                "rl.group_size=4", "rl.mini_batches=2"])
    assert check_layout(cfg, 4).dp_size == 2
    with pytest.raises(ConfigError, match=r"3 processes do not divide into .*parallel.pipeline_parallel=2"):
        check_layout(cfg, 3)
    with pytest.raises(ConfigError, match="parallel.pipeline_parallel must be a positive integer"):
        load_config("configs/tiny_cpu.yaml", ["parallel.pipeline_parallel=0"])


def test_override_syntax():
    assert parse_overrides(["a.b=1", "a.c=x", "d=[1, 2]"]) == {"a": {"b": 1, "c": "x"}, "d": [1, 2]}
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_overrides(["rl.steps"])


def test_every_recipe_in_configs_loads():
    import glob

    from megagspo.config import deferred_path_checks

    recipes = [p for p in glob.glob("configs/*.yaml")]
    assert "configs/tiny_cpu.yaml" in recipes
    for path in recipes:
        # Cluster recipes name data / checkpoint paths of the cluster (absolute); tiny_hf_cpu names the folder
        # `python -m megagspo.tools.tiny_hf_model --out runs/tiny_hf_model` writes; everything else must exist.
        with deferred_path_checks() as missing:
            load_config(path)
        generated = "runs/tiny_hf_model" if path.endswith("tiny_hf_cpu.yaml") else None
        assert all(os.path.isabs(p) or (generated and p.startswith(generated)) for _, p in missing), (path, missing)
        if generated:
            continue
        if "tiny" in path:
            assert not missing and load_config(path)


def test_pipeline_stages_must_split_the_layers(monkeypatch, tmp_path):
    """3 stages cannot split the tiny model's 2 layers: refused naming the setting, before any process group
    or model exists."""
    from megagspo.trainer.trainer import Trainer

    monkeypatch.setenv("WORLD_SIZE", "3")
    cfg = load_config("configs/tiny_cpu.yaml", ["parallel.pipeline_parallel=3", "rl.prompts_per_step=4",
                                                "rl.group_size=4", "rl.mini_batches=2", "data.train_size=50",
                                                "data.eval_size=5", f"log.out_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"parallel.pipeline_parallel do not fit the model: .*num_hidden_layers"):
        Trainer(cfg, quiet=True)
