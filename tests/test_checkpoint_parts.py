"""The checkpoint's state-dict parts in one table (megagspo.checkpoint.parts), restored in one pass by
CheckpointManager.restore_parts: from the files and keys checkpoints have always had (a checkpoint written before
the table resumes), per-rank parts only on the layout that wrote them (else start_afresh, said once), a part the
checkpoint predates left as built, and one registration per name and storage."""

import os
import random
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from megagspo.checkpoint.parts import CheckpointParts, DictState, PerRank, Shared
from megagspo.checkpoint.state import AHEAD, RNG, CheckpointManager, RunRng
from megagspo.config import load_config
from megagspo.data import PromptDataset

LAYOUT = {"tensor_parallel": 1, "expert_parallel": 1, "pipeline_parallel": 1, "data_parallel": 1}


class Held:
    """A per-rank part (the one-step-ahead batch's protocol): what it was given, or that it started afresh."""

    def __init__(self):
        self.loaded, self.afresh = None, None

    def state_dict(self):
        return {"tensors": {"x": torch.arange(3.0)}, "meta": {"n": 3}}

    def load_state_dict(self, tensors, meta):
        self.loaded = (tensors, meta)

    def start_afresh(self, step):
        self.afresh = step


def _manager(tmp_path, said):
    cfg = load_config("configs/tiny_cpu.yaml", [f"log.out_dir={tmp_path}"])
    dims = SimpleNamespace(rank=0, world_size=1, dp_rank=0, shape=SimpleNamespace(as_dict=lambda: dict(LAYOUT)))
    return CheckpointManager(cfg, dims, say=said.append)


def _table(dataset, rng, held, summary):
    table = CheckpointParts()
    table.register("data", dataset, Shared("data"))
    table.register("rng", rng, PerRank("rng", RNG, note="RNG states reseeded"))
    table.register("rollouts_ahead", held, PerRank("rollouts_ahead", AHEAD, note="batch not restored"))
    table.register("summary", DictState(summary), Shared("summary"))
    return table


def _old_checkpoint(path, world=1, layout=LAYOUT):
    """A step folder in the format written before the table: trainer_state keys, rank<r>/ tensors."""
    os.makedirs(path)
    source, gen = PromptDataset(list(range(10)), seed=3), torch.Generator().manual_seed(11)
    source.sample(4)
    torch.manual_seed(5)
    save_file({"rank0/torch": torch.get_rng_state(), "rank0/sample_gen": gen.get_state()}, os.path.join(path, RNG))
    save_file({"rank0/x": torch.arange(3.0)}, os.path.join(path, AHEAD))
    py, np_state = random.getstate(), __import__("numpy").random.get_state()
    state = {"step": 4, "world": world, "layout": layout, "data": source.state_dict(),
             "rng": [{"python": [py[0], list(py[1]), py[2]],
                      "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]),
                                float(np_state[4])]}],
             "rollouts_ahead": [{"n": 3}], "summary": {"rl/time_s": 7.0}}
    return {"path": path, "state": state}, source, gen


def test_a_checkpoint_in_the_format_before_the_table_restores_every_part(tmp_path):
    said = []
    point, source, gen = _old_checkpoint(str(tmp_path / "step_000004"))
    torch.manual_seed(5)
    expect_torch, expect_gen = torch.rand(4), torch.rand(4, generator=gen)
    dataset, held, summary = PromptDataset(list(range(10)), seed=99), Held(), {"device": "cpu"}
    rng = RunRng(torch.Generator().manual_seed(0), seed=1)
    torch.manual_seed(123)  # the run's fresh seeding, overwritten by the restore
    _manager(tmp_path, said).restore_parts(_table(dataset, rng, held, summary), point)
    assert dataset.sample(6) == source.sample(6)                              # data position
    assert torch.equal(torch.rand(4), expect_torch)                           # global torch generator
    assert torch.equal(torch.rand(4, generator=rng.sample_gen), expect_gen)   # mini-batch permutation
    tensors, meta = held.loaded                                               # rank 0's own, prefix stripped
    assert list(tensors) == ["x"] and torch.equal(tensors["x"], torch.arange(3.0)) and meta == {"n": 3}
    assert summary == {"device": "cpu", "rl/time_s": 7.0} and said == []


def test_per_rank_parts_of_another_layout_start_afresh_and_say_so(tmp_path):
    said = []
    point, _, _ = _old_checkpoint(str(tmp_path / "step_000004"), world=2, layout={**LAYOUT, "data_parallel": 2})
    point["state"]["rng"].append(point["state"]["rng"][0])
    held, rng = Held(), RunRng(torch.Generator(), seed=1, dp_rank=0)
    _manager(tmp_path, said).restore_parts(_table(PromptDataset([1, 2]), rng, held, {}), point)
    assert held.loaded is None and held.afresh == 4
    reseeded = torch.Generator().manual_seed(1 * 7919 + 1_000_003 * 4 + 0)
    assert torch.equal(torch.rand(3, generator=rng.sample_gen), torch.rand(3, generator=reseeded))
    assert len(said) == 2 and "RNG states reseeded" in said[0] and "batch not restored" in said[1]


def test_a_part_the_checkpoint_predates_keeps_its_state(tmp_path):
    point, _, _ = _old_checkpoint(str(tmp_path / "step_000004"))
    table = CheckpointParts()
    newer = Held()
    table.register("producer", newer, PerRank("producer", "producer.safetensors"))
    _manager(tmp_path, []).restore_parts(table, point)
    assert newer.loaded is None and newer.afresh is None


def test_names_keys_and_files_are_registered_once():
    table = CheckpointParts()
    table.register("rng", Held(), PerRank("rng", RNG))
    for name, storage in (("rng", Shared("other")), ("x", Shared("rng")), ("y", PerRank("y", RNG))):
        with pytest.raises(ValueError, match="another part's"):
            table.register(name, Held(), storage)
    assert table.names() == ["rng"]
