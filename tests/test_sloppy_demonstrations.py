"""data.demo_drop_carry: the cold-start SFT imitates a demonstrator who drops the carry out of the ones digit on a
fixed fraction of the carrying training problems, while the reward and held-out accuracy check the true sum."""

import pytest

from megagspo.config import ConfigError, load_config
from megagspo.data import build_datasets
from megagspo.data.tasks import carry_dropped, sloppy_demonstrations


def test_carry_dropped_forgets_only_the_ones_carry():
    assert carry_dropped("18+25=") == "33"   # 8 + 5 carries: 43 without it
    assert carry_dropped("12+34=") == "46"   # no carry: the sum
    assert carry_dropped("95+06=") == "91"   # 101 without the ones carry
    assert carry_dropped("57+68=") == "115"  # the tens still carry into the hundreds
    assert carry_dropped("007+005=") == "2"  # any number of digits


def test_sloppy_demonstrations_are_fixed_per_problem_and_only_where_a_carry_is():
    pairs = [(f"{a:02d}+{b:02d}=", str(a + b)) for a in range(0, 100, 3) for b in range(0, 100, 7)]
    demos = sloppy_demonstrations(pairs, 0.6, seed=5)
    assert demos == sloppy_demonstrations(pairs, 0.6, seed=5)
    carrying = [i for i, (p, a) in enumerate(pairs) if carry_dropped(p) != a]
    sloppy = [i for i, (d, (_, a)) in enumerate(zip(demos, pairs)) if d != a]
    assert set(sloppy) <= set(carrying)
    assert all(demos[i] == carry_dropped(pairs[i][0]) for i in sloppy)
    assert 0.5 < len(sloppy) / len(carrying) < 0.7
    assert sloppy_demonstrations(pairs, 0.0, seed=5) == [a for _, a in pairs]
    assert sloppy_demonstrations(pairs, 1.0, seed=5) == [carry_dropped(p) for p, _ in pairs]


def test_build_datasets_gives_demonstrations_to_the_training_split_only():
    cfg = load_config("configs/tiny_cpu.yaml", ["data.demo_drop_carry=0.6", "data.train_size=400", "data.eval_size=50"])
    _, train, held_out, stats = build_datasets(cfg.data)
    for ex in train:
        a, b = ex.prompt[:-1].split("+")
        assert int(ex.answer) == int(a) + int(b)  # the reward's answer stays the true sum
        assert ex.demonstration in (None, carry_dropped(ex.prompt))
        assert ex.demo == (ex.demonstration or ex.answer)
    assert stats["sloppy_demonstrations"] == sum(ex.demonstration is not None for ex in train) > 50
    assert all(ex.demonstration is None and ex.demo == ex.answer for ex in held_out)
    plain = load_config("configs/tiny_cpu.yaml", ["data.demo_drop_carry=0", "data.train_size=400", "data.eval_size=50"])
    _, train0, _, stats0 = build_datasets(plain.data)
    assert [ex.answer for ex in train0] == [ex.answer for ex in train]  # the same problems either way
    assert "sloppy_demonstrations" not in stats0 and all(ex.demonstration is None for ex in train0)


@pytest.mark.parametrize("value", ["-0.1", "1.5", "true"])
def test_demo_drop_carry_must_be_a_fraction(value):
    with pytest.raises(ConfigError, match=r"data.demo_drop_carry must be a fraction in \[0, 1\]"):
        load_config("configs/tiny_cpu.yaml", [f"data.demo_drop_carry={value}"])


def test_demo_drop_carry_leaves_a_file_task_alone(tmp_path):
    """A recipe that sets it (configs/tiny_cpu.yaml) still reads a file task: its demonstrations are its answers."""
    path = tmp_path / "d.jsonl"
    path.write_text("".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(20)))
    cfg = load_config("configs/tiny_cpu.yaml", ["data.task=file", f"data.train_path={path}", "data.eval_size=5",
                                                "data.demo_drop_carry=0.5"])
    _, train, _, stats = build_datasets(cfg.data)
    assert all(ex.demonstration is None and ex.demo == ex.answer for ex in train)
    assert "sloppy_demonstrations" not in stats


def test_sft_trains_on_the_demonstration():
    """The SFT's target tokens are the demonstration's ("33"), not the answer's ("43")."""
    import torch

    from megagspo.data import Example
    from megagspo.data.tokenizer import BuiltinTokenizer
    from megagspo.trainer.sft import ColdStartSFT

    tok = BuiltinTokenizer()
    ex = Example("18+25=", "43", tuple(tok.prompt_ids("18+25=")), demonstration="33")

    class Dims:
        def seq_length(self, natural):
            return natural

    sft = ColdStartSFT(Dims(), type("P", (), {"device": torch.device("cpu")})(), tok, None, None, None, None, None)
    seqs, _ = sft._demonstrations([ex])  # a SequenceBatch: the loss reads its flat targets under its mask
    assert seqs.targets_T[seqs.loss_mask_T].tolist() == tok.encode("33") + [tok.eos_id]
