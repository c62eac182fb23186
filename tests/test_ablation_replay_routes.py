"""Every cell of the default ablation (configs/ablations/moe_volatile_cpu.yaml) that replays routes replays the
right ones, through the real Trainer for one RL step:

  * R3 cells: the routes the rollout engine returned are what the trainer replays, in the pi_old forward and in
    every update. The engine's returned routes are overwritten with a marker route (the last K experts at every
    position it fed) that the model would not choose by itself everywhere; every route the trainer replays must
    then be the marker (fed positions) or the fixed filler (padding), and the marker must appear.
  * R2 cells: the trainer replays pi_old's own routes (recorded in its no-grad forward), never the engine's:
    the engine returns no routes at all, and the replayed routes are not the marker.
  * cells without replay replay nothing in their updates.
"""

from __future__ import annotations

import os

import pytest
import torch

from megagspo.ablation import load_ablation
from megagspo.ablation.spec import _override_list
from megagspo.config import load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(REPO, "configs", "ablations", "moe_volatile_cpu.yaml")
ONE_STEP = ["sft.steps=0", "rl.steps=1", "rl.batch.prompts_per_step=4", "rl.batch.group_size=2", "rl.eval.every=1000",
            "data.train_size=64", "data.eval_size=4", "log.save_checkpoint=false", "log.plots=false",
            "log.tensorboard=false", "log.progress=false", "threads=1"]


def _cells():
    spec = load_ablation(RECIPE)
    return spec, spec.cells()


@pytest.fixture
def spy(monkeypatch):
    """Captures the routes the engine returned (after marking them) and the routes every replay was given."""
    from megagspo.rollout.hf_engine import HFRolloutEngine
    from moe.routing_replay import RoutingReplay

    seen = {"engine": [], "replayed": []}
    generate, replaying = HFRolloutEngine.generate, RoutingReplay.replaying

    def marked_generate(self, prompts, n, sampling, switch=None):
        out = generate(self, prompts, n, sampling, switch=switch)
        if out.routes_RPLyK is not None:
            k, experts = out.routes_RPLyK.shape[-1], self.arch.num_experts
            marker = torch.arange(experts - k, experts, dtype=out.routes_RPLyK.dtype)
            fed = out.routes_RPLyK[..., :1] >= 0
            out.routes_RPLyK = torch.where(fed, marker.expand_as(out.routes_RPLyK), out.routes_RPLyK)
        seen["engine"].append((out.routes_RPLyK, sampling.greedy))
        return out

    def recorded_replaying(self, routes, **kwargs):
        seen["replayed"].append(routes)
        return replaying(self, routes, **kwargs)

    monkeypatch.setattr(HFRolloutEngine, "generate", marked_generate)
    monkeypatch.setattr(RoutingReplay, "replaying", recorded_replaying)
    return seen


def _route_kinds(routes_TLK: torch.Tensor, experts: int):
    """-> (rows equal to the marker, rows equal to the filler, other rows) over the [T*L] route rows."""
    k = routes_TLK.shape[-1]
    rows = routes_TLK.reshape(-1, k).long().sort(dim=-1).values
    marker = torch.arange(experts - k, experts)
    filler = torch.arange(k)
    is_marker = (rows == marker).all(-1)
    is_filler = (rows == filler).all(-1)
    return int(is_marker.sum()), int(is_filler.sum()), int((~is_marker & ~is_filler).sum())


@pytest.mark.parametrize("cell", _cells()[1])
def test_replaying_cells_replay_the_engine_routes_r3_or_pi_old_routes_r2(cell, spy, tmp_path):
    from megagspo.trainer.trainer import Trainer

    spec = load_ablation(RECIPE)
    overrides = _override_list(spec.common) + ONE_STEP + _override_list(spec.cell_spec_overrides(cell))
    cfg = load_config(spec.base, overrides + [f"log.out_dir={tmp_path}", "name=routes"])
    replay = cfg.rl.routing_replay
    experts = cfg.model.num_experts
    assert experts - cfg.model.num_experts_per_tok >= cfg.model.num_experts_per_tok  # marker != filler
    Trainer(cfg, quiet=True).train(rl=True)

    training = [r for r, greedy in spy["engine"] if not greedy]  # the RL rollout, not the held-out evals
    assert training, "the RL step generated no rollout"
    if replay == "r3":
        assert all(r is not None for r in training), "R3: the engine returned no routes"
        assert spy["replayed"], "R3: nothing was replayed"
        marked = 0
        for routes in spy["replayed"]:
            for routes_TLK in (routes if isinstance(routes, (list, tuple)) else [routes]):
                m, _, other = _route_kinds(routes_TLK, experts)
                assert other == 0, f"{cell}: {other} replayed routes are neither the engine's nor padding"
                marked += m
        assert marked > 0, f"{cell}: no replayed route came from the engine"
    elif replay == "r2":
        assert all(r is None for r in training), "R2 reads no engine routes, so none should be asked for"
        assert spy["replayed"], "R2: nothing was replayed"
        for routes in spy["replayed"]:
            for routes_TLK in (routes if isinstance(routes, (list, tuple)) else [routes]):
                m, _, other = _route_kinds(routes_TLK, experts)
                # pi_old's own top-k varies from token to token; a row may hit the marker set by chance
                assert other > 0 and m < other, f"{cell}: R2 replayed the engine's (marked) routes"
    else:
        assert spy["replayed"] == [], f"{cell}: an arm without replay replayed routes"
