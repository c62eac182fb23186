"""Rollout sources (megagspo.rl.sources): one rule picks the source a recipe gets, and the RL step
never branches on the rollout mode. The sources' behaviour end to end is in test_rollouts_ahead.py (one step
ahead: versions, resume), test_rollout_producer.py (the producer process), test_dynamic_sampling.py (group-filtered rounds) and the golden metrics
(synchronous, bit for bit)."""

from __future__ import annotations

import ast
import os

import pytest

from helpers import REPO


def test_one_rule_picks_the_source():
    from megagspo.config import ConfigError
    from megagspo.rl.sources import GroupFiltered, OneStepAhead, Produced, Synchronous, source_class

    assert source_class(0, False, 1) is Synchronous  # staleness 0 never starts a producer, whatever rollout.producer
    assert source_class(0, True, 4, "process") is GroupFiltered
    assert source_class(1, False, 1) is Produced  # auto: a process for the embedded engine
    assert source_class(1, False, 1, "auto", "sglang") is OneStepAhead  # auto: the thread for a server
    assert source_class(1, False, 1, "thread") is OneStepAhead
    assert source_class(4, True, 1, "process") is Produced  # dynamic sampling at any staleness
    with pytest.raises(ConfigError, match="rl.filter.enabled = true is not supported by it"):
        source_class(1, True, 1, "thread")
    with pytest.raises(ConfigError, match="rollout.staleness = 2"):
        source_class(2, False, 1, "thread")
    with pytest.raises(ConfigError, match="pipeline_parallel = 1"):
        source_class(1, False, 2, "thread")
    with pytest.raises(ConfigError, match="rollout.engine = hf"):
        source_class(2, False, 1, "process", "sglang")


def test_the_step_has_no_rollout_mode_branches():
    """RLStep reads no rollout-mode key and holds no engine, reference or replay internals (narrow faces:
    policy.recording / replaying / replay_spec, reference.logprobs, engine_link.seeded_generator)."""
    source = open(os.path.join(REPO, "megagspo", "rl", "step.py")).read()
    names = {n.attr for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Attribute)}
    assert not names & {"staleness", "filter_groups", "filter_max_rounds", "ahead"}
    chains = {ast.unparse(n) for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Attribute)}
    reach_throughs = [c for c in chains if any(p in c for p in (".replay.", ".engine.engine", "reference.policy"))]
    assert not reach_throughs, reach_throughs
