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
