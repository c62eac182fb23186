"""Data: JSONL / parquet prompts, the synthetic task's disjoint split, and clear errors for bad input."""

import json

import pytest

from megagspo.config import ConfigError, load_config
from megagspo.data import BuiltinTokenizer, DataError, addition_examples, build_datasets


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_addition_split_is_disjoint_and_correct():
    train, held = addition_examples(2, 500, 100, seed=1)
    assert len(train) == 500 and len(held) == 100
    assert not {p for p, _ in train} & {p for p, _ in held}
    for prompt, answer in train[:50]:
        a, b = prompt[:-1].split("+")
        assert int(a) + int(b) == int(answer) and len(a) == len(b) == 2


def test_builtin_tokenizer_roundtrip():
    tok = BuiltinTokenizer()
    ids = tok.encode("12+34=")
    assert tok.decode(ids + [tok.eos_id, 5]) == "12+34="
    with pytest.raises(ValueError, match="cannot encode character 'x'"):
        tok.encode("x")


def test_jsonl_dataset_loads(tmp_path):
    rows = [{"question": f"{i}+1=", "sol": str(i + 1)} for i in range(20)]
    path = _write(tmp_path / "d.jsonl", rows)
    cfg = load_config("configs/tiny_cpu.yaml", ["data.task=file", f"data.train_path={path}", "data.eval_size=5",
                                                "data.prompt_key=question", "data.answer_key=sol"])
    _, train, held, stats = build_datasets(cfg.data)
    assert len(train) == 15 and len(held) == 5 and stats["dropped_long_prompts"] == 0


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config("configs/tiny_cpu.yaml", ["data.task=file", f"data.train_path={tmp_path}/nope.jsonl"])


def test_wrong_field_names_are_reported(tmp_path):
    path = _write(tmp_path / "d.jsonl", [{"question": "1+1=", "answer": "2"}] * 10)
    cfg = load_config("configs/tiny_cpu.yaml", ["data.task=file", f"data.train_path={path}", "data.eval_size=2"])
    with pytest.raises(DataError, match=r"row 0 has no field 'prompt'.*\['answer', 'question'\]"):
        build_datasets(cfg.data)


def test_long_prompts_are_counted(tmp_path):
    rows = [{"prompt": "1+1=", "answer": "2"}] * 8 + [{"prompt": "1111111111+1=", "answer": "1111111112"}] * 3
    path = _write(tmp_path / "d.jsonl", rows)
    base = ["data.task=file", f"data.train_path={path}", "data.eval_size=2", "data.max_response_tokens=12"]
    cfg = load_config("configs/tiny_cpu.yaml", base)
    with pytest.raises(DataError, match=r"3 of \d+ prompts are longer than data.max_prompt_tokens = 8"):
        build_datasets(cfg.data)
    cfg = load_config("configs/tiny_cpu.yaml", base + ["data.drop_long_prompts=true", "data.seed=3"])
    _, train, held, stats = build_datasets(cfg.data)
    assert stats["dropped_long_prompts"] == 3 and len(train) + len(held) == 8


def test_bad_json_names_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{oops\n')
    cfg = load_config("configs/tiny_cpu.yaml", ["data.task=file", f"data.train_path={path}", "data.eval_size=1"])
    with pytest.raises(DataError, match=r"d.jsonl:2: not valid JSON"):
        build_datasets(cfg.data)


def test_chat_message_prompts_and_nested_answers_from_parquet_and_jsonl(tmp_path):
    """Hugging Face math datasets: parquet rows whose prompt is a chat message list and whose answer sits in a
    nested field (`reward_model.ground_truth`), and the same rows as JSONL."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megagspo.data import load_examples

    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{i}+1="}],
             "reward_model": {"ground_truth": str(i + 1), "style": "rule"}, "extra": i} for i in range(12)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    _write(tmp_path / "d.jsonl", rows)
    for name in ("d.parquet", "d.jsonl"):
        pairs = load_examples(str(tmp_path / name), "prompt", "reward_model.ground_truth")
        assert len(pairs) == 12
        prompt, answer = pairs[3]
        assert answer == "4" and prompt == ({"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "3+1="})
    with pytest.raises(DataError, match=r"row 0 has no field 'reward_model.answer' \(data.answer_key\)"):
        load_examples(str(tmp_path / "d.parquet"), "prompt", "reward_model.answer")


def test_broken_parquet_is_a_data_error(tmp_path):
    from megagspo.data import load_examples

    (tmp_path / "d.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match="not a readable parquet file"):
        load_examples(str(tmp_path / "d.parquet"))


def _file_recipe(train, eval_path, *extra):
    return load_config("configs/tiny_cpu.yaml", ["data.task=file", f"data.train_path={train}",
                                                 f"data.eval_path={eval_path}", "data.max_response_tokens=5",
                                                 *extra])


def test_response_limit_applies_to_what_it_limits_and_reads_every_row(tmp_path):
    """data.max_response_tokens limits SFT demonstrations (answer + eos), or the answers a whole-answer reward
    compares; a reward reading a final answer out of free text (math, last_number) without SFT is not limited
    by the gold solution's length. Every row is read: the one long answer sits at row 70."""
    from megagspo.data.datasets import response_check_for

    rows = [{"prompt": f"{i % 10}+1=", "answer": str(i % 10 + 1)} for i in range(80)]
    rows[70]["answer"] = "1 + 2 + 3 = 6"  # 13 characters: over the limit of 5 tokens
    train = _write(tmp_path / "train.jsonl", rows)
    held = _write(tmp_path / "eval.jsonl", rows[:4])
    cfg = _file_recipe(train, held)
    assert response_check_for(cfg.sft.steps, cfg.reward.name) == "sft"
    with pytest.raises(DataError, match=r"train.jsonl: 1 of 80 answers are longer than data.max_response_tokens = 5 "
                                        r"tokens as SFT demonstrations .*'1 \+ 2 \+ 3 = 6', needs 14"):
        build_datasets(cfg.data, response_check="sft")
    with pytest.raises(DataError, match=r"1 of 80 answers .* as responses the reward compares whole"):
        build_datasets(cfg.data, response_check=response_check_for(0, "exact_match"))
    assert response_check_for(0, "math") is None and response_check_for(0, "last_number") is None
    _, train_ex, _, _ = build_datasets(cfg.data, response_check=None)
    assert len(train_ex) == 80
    # a whole-answer reward also limits the held-out answers (accuracy is that reward on them)
    ok = _write(tmp_path / "train_ok.jsonl", rows[:60])
    long_eval = _write(tmp_path / "eval_long.jsonl", rows[68:72])
    cfg = _file_recipe(ok, long_eval)
    with pytest.raises(DataError, match=r"eval_long.jsonl: 1 of 4 answers"):
        build_datasets(cfg.data, response_check="reward")
    build_datasets(cfg.data, response_check="sft")  # SFT trains on the training split only


def test_trainer_picks_the_response_check_from_sft_and_reward(tmp_path):
    """Through the Trainer: no SFT + the math reward starts with gold solutions longer than the response limit."""
    from megagspo.config import ConfigError
    from megagspo.trainer.trainer import Trainer

    rows = [{"prompt": f"{i % 10}+1=", "answer": str(i % 10 + 1)} for i in range(20)]
    rows[3]["answer"] = "1 + 2 + 3 = 6"
    train, held = _write(tmp_path / "train.jsonl", rows), _write(tmp_path / "eval.jsonl", rows[:4])
    common = ["rl.prompts_per_step=2", "rl.group_size=2", "rl.mini_batches=1", "data.eval_size=4",
              "log.save_checkpoint=false", f"log.out_dir={tmp_path / 'runs'}", "log.plots=false",
              "log.tensorboard=false", "log.progress=false"]
    with pytest.raises((DataError, ConfigError), match="as SFT demonstrations"):
        Trainer(_file_recipe(train, held, *common), quiet=True)
    trainer = Trainer(_file_recipe(train, held, *common, "sft.steps=0", "reward.name=last_number"), quiet=True)
    assert trainer.data_stats["train_examples"] == 20


def test_eval_size_caps_an_eval_file_to_a_fixed_subset(tmp_path):
    rows = [{"prompt": f"{i}+0=", "answer": str(i)} for i in range(40)]
    train = _write(tmp_path / "train.jsonl", rows[:10])
    held = _write(tmp_path / "eval.jsonl", rows)
    _, _, first, stats = build_datasets(_file_recipe(train, held, "data.eval_size=12").data)
    assert len(first) == 12 and stats["eval_examples"] == 12 and stats["eval_file_rows"] == 40
    answers = [int(ex.answer) for ex in first]
    assert answers == sorted(answers) and len(set(answers)) == 12  # distinct rows, in file order
    _, _, again, _ = build_datasets(_file_recipe(train, held, "data.eval_size=12").data)
    assert [ex.answer for ex in again] == [ex.answer for ex in first]  # fixed: the same rows every run
    _, _, other, _ = build_datasets(_file_recipe(train, held, "data.eval_size=12", "data.seed=7").data)
    assert [ex.answer for ex in other] != [ex.answer for ex in first]  # drawn with data.seed
    _, _, everything, _ = build_datasets(_file_recipe(train, held, "data.eval_size=40").data)
    assert [int(ex.answer) for ex in everything] == list(range(40))


def test_30b_recipes_evaluate_on_a_fixed_subset_and_say_how_to_use_all_of_it():
    import glob
    import os

    from megagspo.config import deferred_path_checks

    recipes = sorted(glob.glob("configs/qwen3_30b_a3b_*.yaml"))
    assert len(recipes) >= 5
    for recipe in recipes:
        with deferred_path_checks():
            cfg = load_config(recipe)
        assert cfg.data.eval_path and cfg.data.eval_size < 1319, recipe  # GSM8K's test split has 1,319 rows
        with open(recipe) as f:
            assert "data.eval_size=1319 evaluates on the whole test split" in f.read(), os.path.basename(recipe)
