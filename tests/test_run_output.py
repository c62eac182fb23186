"""What a person reads (issue 30 item 4): values that were not measured are said to be so (never 0.000), noisy
curves are smoothed with the raw values faint behind, the clip plot separates low and high clipping, library
noise is filtered (the shim's patch log in one line), and `megagspo --help` lists every command on one line."""

import logging
import os
import warnings

import pytest

from megagspo.metrics_log import (clip_series, cold_start_line, eval_record, final_line, smooth, smoothing_window,
                                  write_plots)

EVAL = {"eval/accuracy": 0.5, "eval/sampled_accuracy": 0.0, "eval/count": 300.0}
FINAL = {"eval/accuracy": 0.75, "eval/sampled_accuracy": 0.0, "eval/count": 300.0}


def test_without_cold_start_sft_the_line_does_not_claim_one():
    line = cold_start_line({"eval/accuracy": 0.5}, EVAL, sft_steps=0)
    assert "after cold-start SFT" not in line and "no cold-start SFT (sft.steps=0)" in line, line
    line = cold_start_line({"eval/accuracy": 0.1}, EVAL, sft_steps=250)
    assert line == "held-out accuracy: initial 0.100, after cold-start SFT 0.500 (300 problems, greedy)"


def test_sampled_accuracy_that_was_not_measured_is_said_so_and_not_recorded():
    line = final_line(FINAL, EVAL, rl_steps=600, loss="gspo", sft_steps=0, eval_samples=0, temperature=1.0)
    assert line == ("held-out accuracy after 600 gspo steps: greedy 0.750 (before RL 0.500), "
                    "sampled: not measured (rl.eval.samples=0)")
    # (the held-out time-out count is always recorded: issue 49)
    assert eval_record("final", FINAL, eval_samples=0) == {"final/accuracy": 0.75, "final/timeouts": 0}
    measured = dict(FINAL, **{"eval/sampled_accuracy": 0.6})
    line = final_line(measured, dict(EVAL, **{"eval/sampled_accuracy": 0.4}), rl_steps=600, loss="gspo", sft_steps=250,
                      eval_samples=4, temperature=1.0)
    assert line.endswith("greedy 0.750 (cold start 0.500), sampled T=1 0.600 (cold start 0.400)"), line
    assert eval_record("final", measured, eval_samples=4) == {"final/accuracy": 0.75, "final/sampled_accuracy": 0.6,
                                                               "final/timeouts": 0}


def test_smoothing_is_a_trailing_mean_over_the_window():
    assert smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert smooth([2.0, 4.0], 1) == [2.0, 4.0]
    assert smoothing_window(10) == 1 and smoothing_window(600) == 30


def _rows(n):
    return [{"phase": "rl", "step": float(i), "reward/mean": (i % 3) / 2, "clip/seq_low_frac": 0.1,
             "clip/seq_high_frac": 0.3, "clip/tok_frac": 0.35, "clip/seq_frac": 0.4, "moe/expert_volatility": 0.01,
             "eval/accuracy": 0.5, "eval/sampled_accuracy": 0.0, "eval/fresh": float(i % 10 == 9)} for i in range(n)]


def test_clip_plot_separates_low_and_high_and_draws_gspo_tokens_once():
    rows = _rows(4)
    gspo = clip_series(rows, "gspo")
    assert [label.split(" (")[0] for label, _ in gspo] == ["sequences clipped low", "sequences clipped high"]
    assert [values[0] for _, values in gspo] == [0.1, 0.3]
    grpo = clip_series(rows, "grpo")
    assert len(grpo) == 3 and grpo[2][0].startswith("tokens clipped") and grpo[2][1][0] == 0.35


def test_plots_draw_raw_values_faint_behind_the_smoothed_curve(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = {}
    real_close = plt.close

    def keep(fig):  # the figures' lines, read before each is closed
        drawn[fig.axes[0].get_title()] = [(line.get_label(), line.get_alpha()) for line in fig.axes[0].get_lines()]
        real_close(fig)

    monkeypatch.setattr(plt, "close", keep)
    paths = write_plots(_rows(100), str(tmp_path), 0.5, loss="gspo", sampled_measured=False,
                        cold_start_label="before RL")
    assert sorted(os.path.basename(p) for p in paths) == ["clip_fraction.png", "expert_volatility.png",
                                                          "reward_accuracy.png"]
    reward = drawn["GSPO: reward and held-out accuracy"]
    faint = [alpha for label, alpha in reward if label.startswith("_")]  # unlabelled: the raw curve
    assert faint == [0.25], reward
    labels = [label for label, _ in reward if not label.startswith("_")]
    # no sampled held-out accuracy: it was not measured
    assert labels == ["train reward (sampled, T=1), mean of 5 steps", "held-out accuracy (greedy)", "before RL 0.500"]
    clip_labels = [label for label, _ in drawn["clipped fraction (gspo)"] if not label.startswith("_")]
    assert [label.split(" (")[0] for label in clip_labels] == ["sequences clipped low", "sequences clipped high"]


def test_library_noise_is_filtered_and_the_shim_log_is_one_line(monkeypatch, capsys):
    from megagspo import cli

    monkeypatch.delenv("MEGAGSPO_VERBOSE", raising=False)
    monkeypatch.setenv("RANK", "0")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cli._quiet_third_party()
        warnings.warn("`torch.distributed.reduce_scatter_tensor` is deprecated. Please use "
                      "`torch.distributed.reduce_scatter_single` instead.", FutureWarning)
        warnings.warn("something a user should read", UserWarning)
    assert [str(w.message) for w in seen] == ["something a user should read"]
    shim = logging.getLogger("moe.cpu_shim")
    for i in range(3):
        shim.warning("megagspo CPU shim: patch %d", i)
    cli._PATCH_LINES.say_once()
    out = capsys.readouterr()
    assert "patch 0" not in out.err + out.out
    assert out.out.count("3 logged patches make megatron-core run here") == 1 and "MEGAGSPO_VERBOSE=1" in out.out
    cli._PATCH_LINES.say_once()
    assert capsys.readouterr().out == ""  # said once


def test_help_lists_every_command_on_one_line(capsys, monkeypatch):
    from megagspo.cli import main

    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    lines = text.splitlines()
    for command in ("train", "sft", "plan", "export", "ablate"):
        [line] = [ln for ln in lines if ln.split()[:1] == [command]]
        assert len(line.split()) > 3, line  # a description on the command's own line
        following = lines[lines.index(line) + 1]
        assert not following.startswith(" " * 12), (line, following)  # not wrapped onto a second line


def test_megatron_log_records_are_shown_once_without_the_expected_ones():
    from megagspo.cli import _LibraryLog

    keep = _LibraryLog()

    def record(message):
        return logging.LogRecord("megatron.core.transformer", logging.WARNING, __file__, 1, message, None, None)

    assert not keep.filter(record("Unknown MLP type: <class 'ModuleSpec'>. Using default kwargs."))
    assert keep.filter(record("a real problem")) and not keep.filter(record("a real problem"))
