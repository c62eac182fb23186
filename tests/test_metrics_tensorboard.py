"""TensorBoard logging is on after `make install`: the metrics rows reach an event file TensorBoard reads."""

from megagspo.metrics_log import MetricsLogger


def test_metrics_reach_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(str(tmp_path), tensorboard=True)
    assert logger.tb is not None and not logger.tb_note
    for step in range(3):
        logger.log({"step": step, "phase": "rl", "reward/mean": 0.25 * step, "loss": 1.0 - step})
    logger.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["loss", "reward/mean"]
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(0, 0.0), (1, 0.25), (2, 0.5)]
