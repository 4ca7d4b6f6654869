"""attnmt.training.runlog: the throughput meter and the progress bar of a training run."""

import pytest

import attnmt.training.runlog as runlog


def test_throughput_meter_windows():
    now = [10.0]
    meter = runlog.ThroughputMeter(lambda: now[0])
    result = runlog.StepResult(1, 5.0, 100, 300, 240, 1e-3, 1.0, True, True, False)
    meter.add(result)
    meter.add(result)
    now[0] = 12.0
    w = meter.take()
    assert (w.tokens, w.seconds, w.tokens_per_s) == (200, 2.0, 100.0)
    assert w.padding == pytest.approx(0.2)
    now[0] = 13.0
    assert meter.take().tokens == 0  # a new window


def test_progress_bar_refreshes_its_numbers_every_second(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(runlog.time, "monotonic", lambda: now[0])
    bar = runlog.ProgressBar(100, 0, enabled=True)
    shown = []
    monkeypatch.setattr(bar.bar, "set_postfix", lambda **kw: shown.append(kw["loss"]))
    for step in range(1, 6):
        now[0] += 0.4
        bar.update(runlog.StepResult(step, step * 100.0, 100, 1, 1, 1e-3, 1.0, True, True, False))
    bar.close()
    # step 1 at once, then whenever a second has passed: steps 4 (1.6 s) and none after yet
    assert shown == ["1.000", "4.000"]
