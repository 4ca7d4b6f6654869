import pytest

from attnmt.config import TeacherForcingConfig
from attnmt.training.schedules import inverse_sqrt_lr, teacher_forcing_ratio, warmup_lr


def tf(schedule, step, start=1.0, end=0.5, steps=100):
    return teacher_forcing_ratio(
        step, TeacherForcingConfig(schedule=schedule, start=start, end=end, steps=steps)
    )


def test_steps_count_from_one():
    """Step 1 (the first step trained) takes the start ratio, as it takes the first warmup lr."""
    assert tf("linear", 1) == 1.0 and tf("linear", 0) == 1.0
    assert tf("linear", 2) < 1.0


def test_constant():
    assert tf("constant", 1) == 1.0 and tf("constant", 10**6) == 1.0


def test_linear():
    assert tf("linear", 1) == 1.0
    assert tf("linear", 51) == pytest.approx(0.75)
    assert tf("linear", 101) == pytest.approx(0.5)
    assert tf("linear", 1001) == pytest.approx(0.5)


def test_exponential_is_geometric():
    assert tf("exponential", 1) == pytest.approx(1.0)
    assert tf("exponential", 51) == pytest.approx(0.5**0.5)
    assert tf("exponential", 101) == pytest.approx(0.5)
    assert tf("exponential", 501) == pytest.approx(0.5)


def test_inverse_sigmoid():
    assert tf("inverse_sigmoid", 1) == pytest.approx(1.0)
    assert tf("inverse_sigmoid", 51) == pytest.approx(0.75)  # symmetric around the middle
    assert tf("inverse_sigmoid", 101) == pytest.approx(0.5)
    values = [tf("inverse_sigmoid", s) for s in range(1, 102, 10)]
    assert values == sorted(values, reverse=True)
    assert tf("inverse_sigmoid", 11) > tf("linear", 11)  # flat start, then a steep drop


def test_schedules_can_rise_too():
    assert tf("linear", 51, start=0.0, end=1.0) == pytest.approx(0.5)


def test_inverse_sqrt_lr():
    assert inverse_sqrt_lr(1, 1e-3, 100) == pytest.approx(1e-5)
    assert inverse_sqrt_lr(100, 1e-3, 100) == pytest.approx(1e-3)
    assert inverse_sqrt_lr(400, 1e-3, 100) == pytest.approx(5e-4)
    assert inverse_sqrt_lr(5, 1e-3, 0) == 1e-3


def test_warmup_lr():
    assert warmup_lr(5, 1e-3, 10) == pytest.approx(5e-4)
    assert warmup_lr(50, 1e-3, 10) == 1e-3
