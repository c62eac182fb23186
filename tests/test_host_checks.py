"""Issue 49, item 3: the settings whose check needs the machine (megagspo.trainer.host_checks) are checked by the
preflight, so `megagspo train --dry-run` refuses them in one line naming the key, as a run does at start-up,
instead of failing after the cold start (`rollout.producer_cpus=[64]` on a 2-core box: six tracebacks, exit 1)."""

from __future__ import annotations

import multiprocessing
import os
import sys
from types import SimpleNamespace

import pytest

from helpers import REPO

CONFIG = os.path.join(REPO, "configs", "tiny_cpu.yaml")
PRODUCER = ["rollout.staleness=2", "rollout.producer=process"]


def _no_math_verify(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # importlib.util.find_spec then answers None


def _daemonic(monkeypatch, tmp_path):
    from megagspo.trainer import host_checks

    monkeypatch.setattr(host_checks.multiprocessing, "current_process", lambda: SimpleNamespace(daemon=True))


def _out_dir_file(monkeypatch, tmp_path):
    (tmp_path / "file").write_text("not a folder")


# The settings the dry run checks against this machine: (overrides, setup, what the one line says). One per key of
# host_checks.HOST_CHECKED (asserted below), so a check added there comes with its case here.
CASES = {
    "rollout.producer_cpus": ([*PRODUCER, "rollout.producer_cpus=[0,4096]"], None,
                              "rollout.producer_cpus = [0, 4096]: core 4096 is not among the"),
    "rollout.producer": (PRODUCER, _daemonic, "rollout.producer = process (or auto with rollout.engine = hf) starts a "
                                              "producer process, which this process, a daemonic multiprocessing child"),
    "reward.name": (["reward.name=math"], _no_math_verify, "reward.name = 'math' needs the math-verify package"),
    "log.out_dir": (["log.out_dir={tmp}/file/runs"], _out_dir_file, "log.out_dir = '{tmp}/file/runs': {tmp}/file is a "
                                                                    "file, not a directory"),
}


def test_the_cases_cover_every_setting_checked_against_the_machine():
    from megagspo.trainer.host_checks import HOST_CHECKED

    assert sorted(CASES) == sorted(HOST_CHECKED)


@pytest.mark.parametrize("key", sorted(CASES))
def test_the_dry_run_refuses_a_setting_this_machine_cannot_run_naming_the_key(key, monkeypatch, tmp_path, capsys):
    from megagspo.cli import main

    overrides, setup, said = CASES[key]
    if setup is not None:
        setup(monkeypatch, tmp_path)
    rc = main(["train", "--dry-run", "--config", CONFIG, *[o.format(tmp=tmp_path) for o in overrides]])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith("megagspo train: error: " + said.format(tmp=tmp_path)), lines[0]


def test_cores_this_process_may_run_on_pass(capsys):
    from megagspo.cli import main
    from megagspo.trainer.host_checks import usable_cores

    cores = usable_cores()
    if not cores:
        pytest.skip("the platform does not say which cores this process may use")
    rc = main(["train", "--dry-run", "--config", CONFIG, *PRODUCER, f"rollout.producer_cpus=[{cores[-1]}]"])
    assert rc == 0, capsys.readouterr().err


def test_the_run_itself_refuses_before_anything_is_written(tmp_path):
    """The trainer goes through the same preflight: refused at start-up, the run folder never made."""
    from megagspo.config import ConfigError, load_config
    from megagspo.trainer.run_inputs import read_run_inputs

    cfg = load_config(CONFIG, [*PRODUCER, "rollout.producer_cpus=[4096]", "data.train_size=20", "data.eval_size=3",
                               f"log.out_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"rollout.producer_cpus = \[4096\]"):
        read_run_inputs(cfg)
    assert os.listdir(tmp_path) == []


def test_core_spans_and_a_folder_that_does_not_exist_yet(tmp_path):
    from megagspo.trainer.host_checks import _spans, check_out_dir

    assert _spans([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8" and _spans([3]) == "3"
    check_out_dir(str(tmp_path / "a" / "b"))  # made by the run (a cluster's scratch seen from a login node)
    assert multiprocessing.current_process().daemon is False
