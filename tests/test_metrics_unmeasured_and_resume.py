"""Issue 30 item 4 / rerun rules, the metrics files:
- held-out sampled accuracy that was not measured (rl.eval_samples = 0) is absent from the evaluation result
  and from every metrics.jsonl row, never recorded as 0.0;
- a resumed run re-writes the rows up to its checkpoint into metrics.jsonl but not into TensorBoard (the first
  process's event file holds them), so TensorBoard shows every step once."""

import json
from types import SimpleNamespace

from megagspo.config import load_config
from megagspo.metrics_log import MetricsLogger
from megagspo.trainer.evaluation import Evaluator
from megagspo.trainer.run_files import open_run_files


class _Dims:
    dp_rank, dp_size = 0, 1

    def on_mp_rank0(self, _what, fn):
        return fn()

    def on_rank0(self, _what, fn):
        return fn()

    def dp_sum(self, values):
        return values


def test_sampled_accuracy_is_absent_when_not_measured():
    import torch

    from megagspo.data import build_datasets
    from megagspo.rollout.base import RolloutOutput

    cfg = load_config("configs/tiny_cpu.yaml", ["data.train_size=20", "data.eval_size=6"])
    tok, _, held_out, _ = build_datasets(cfg.data)
    calls = []

    class Engine:  # answers every prompt with "1" + eos
        def generate(self, prompts, n, params):
            calls.append((n, params.greedy))
            rows = len(prompts) * n
            ids = torch.tensor([tok.encode("1") + [tok.eos_id]] * rows)
            return RolloutOutput([list(p) for p in prompts for _ in range(n)], ids,
                                 torch.ones_like(ids, dtype=torch.bool), torch.zeros(ids.shape))

    def evaluator(samples):
        engine = Engine()
        return Evaluator(_Dims(), lambda: engine, tok, lambda r, a: float(r.strip() == a), held_out, 5, samples, 1.0, 1.0)

    greedy_only = evaluator(0)()
    assert "eval/sampled_accuracy" not in greedy_only and calls == [(1, True)]
    # eval/timeouts is measured whatever the settings (verifier calls cut off at reward.timeout_s; here 0)
    assert set(greedy_only) == {"eval/accuracy", "eval/response_length", "eval/count", "eval/timeouts"}
    assert greedy_only["eval/timeouts"] == 0
    calls.clear()
    both = evaluator(2)()
    assert "eval/sampled_accuracy" in both and calls == [(1, True), (2, False)]


def _tb_points(tb_dir, tag):
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    mux = EventMultiplexer({"run": str(tb_dir)}).Reload()
    return sorted((e.step, e.value) for e in mux.Scalars("run", tag))


def test_resume_does_not_log_the_earlier_rows_to_tensorboard_again(tmp_path):
    cfg = load_config("configs/tiny_cpu.yaml", [f"log.out_dir={tmp_path}", "name=r"])
    run_dir = tmp_path / "r"
    first = MetricsLogger(str(run_dir), tensorboard=True)  # the first process: steps 0-2, then stopped
    rows = [{"phase": "rl", "step": s, "reward/mean": 0.1 * s} for s in range(3)]
    for row in rows:
        first.log(row)
    first.close()

    ckpt = SimpleNamespace(retire_previous=lambda: None, prior_metrics=lambda point, path: list(rows))
    logger = open_run_files(cfg, _Dims(), ckpt, resume={"state": "checkpoint after step 3"})
    for s in (3, 4):
        logger.log({"phase": "rl", "step": s, "reward/mean": 0.1 * s})
    logger.close()

    with open(run_dir / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [0, 1, 2, 3, 4]
    points = _tb_points(run_dir / "tb", "reward/mean")
    assert [s for s, _ in points] == [0, 1, 2, 3, 4], points  # each step once, across both event files
