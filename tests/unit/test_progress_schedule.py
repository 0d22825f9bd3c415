"""LR schedules keyed to the global step: a reload at any step gives the uninterrupted run's LR."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, LinearLR, SequentialLR, StepLR

from elastic.schedule import GlobalStepLR, SchedulerFactory, WarmupCosineConfig, warmup_cosine, warmup_cosine_factor

pytestmark = pytest.mark.timeout(60)


def fresh_optimizer(lr: float = 0.3) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))]
    return torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "lr": lr / 3}], lr=lr)


def chained_warmup_cosine(optimizer: torch.optim.Optimizer) -> SequentialLR:
    # Chainable schedulers compute each LR from the previous one, so only a
    # replay of the same steps reproduces their floats exactly.
    warmup = LinearLR(optimizer, start_factor=0.1, total_iters=4)
    cosine = CosineAnnealingLR(optimizer, T_max=16, eta_min=0.01)
    return SequentialLR(optimizer, [warmup, cosine], milestones=[4])


FACTORIES: dict[str, SchedulerFactory] = {
    "sequential": chained_warmup_cosine,
    "step": lambda opt: StepLR(opt, step_size=3, gamma=0.5),
    "warmup_cosine": warmup_cosine(WarmupCosineConfig(total_steps=20, warmup_steps=4)),
}


def uninterrupted_lrs(build: SchedulerFactory, steps: int) -> list[list[float]]:
    optimizer = fresh_optimizer()
    scheduler = build(optimizer)
    lrs = []
    for _ in range(steps):
        lrs.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize("name", FACTORIES)
def test_wrapper_follows_the_plain_scheduler(name: str) -> None:
    optimizer = fresh_optimizer()
    schedule = GlobalStepLR(optimizer, FACTORIES[name])
    lrs = []
    for _ in range(20):
        lrs.append(schedule.current_lrs())
        optimizer.step()
        schedule.advance()
    assert lrs == uninterrupted_lrs(FACTORIES[name], 20)
    assert schedule.global_step == 20


@pytest.mark.parametrize("name", FACTORIES)
@pytest.mark.parametrize("resume_at", [0, 3, 4, 11, 19])
def test_reload_gives_bitwise_the_uninterrupted_lr(name: str, resume_at: int) -> None:
    expected = uninterrupted_lrs(FACTORIES[name], 20)
    before = GlobalStepLR(fresh_optimizer(), FACTORIES[name])
    before.set_step(resume_at)
    state = before.state_dict()
    assert isinstance(before, Stateful) and state == {"global_step": resume_at}

    # A new process: fresh optimizer whose param groups carry another run's LRs,
    # as they do after the optimizer state is loaded from the checkpoint.
    optimizer = fresh_optimizer()
    after = GlobalStepLR(optimizer, FACTORIES[name])
    for group in optimizer.param_groups:
        group["lr"] = 123.0
    after.load_state_dict(state)
    for step in range(resume_at, 20):
        assert after.current_lrs() == expected[step], f"step {step}"
        optimizer.step()
        after.advance()


def test_regenerate_positions_at_the_step() -> None:
    expected = uninterrupted_lrs(FACTORIES["sequential"], 10)
    schedule = GlobalStepLR(fresh_optimizer(), FACTORIES["sequential"])
    schedule.regenerate_state(7)
    assert schedule.current_lrs() == expected[7] and schedule.state_dict() == {"global_step": 7}


def test_negative_step_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot be negative"):
        GlobalStepLR(fresh_optimizer(), FACTORIES["step"]).set_step(-1)


def test_warmup_cosine_shape() -> None:
    config = WarmupCosineConfig(total_steps=10, warmup_steps=2, min_lr_ratio=0.1)
    factors = [warmup_cosine_factor(config, step) for step in range(11)]
    assert factors[0] == pytest.approx(1 / 3) and factors[1] == pytest.approx(2 / 3)
    assert factors[2] == pytest.approx(1.0)
    assert all(a > b for a, b in zip(factors[2:10], factors[3:11]))
    assert factors[10] == pytest.approx(0.1)


def test_warmup_longer_than_the_run_is_refused() -> None:
    with pytest.raises(ValidationError, match="warmup_steps .* exceeds total_steps"):
        WarmupCosineConfig(total_steps=5, warmup_steps=6)


def test_a_lambda_schedule_is_positioned_without_replaying_its_steps() -> None:
    """LambdaLR's learning rate is base lr x lambda(step): positioning at step 1,000,000 asks lambda about that
    step once, not a million times, and gives the rate its millionth step gives."""
    config = WarmupCosineConfig(total_steps=2_000_000, warmup_steps=1000)
    asked: list[int] = []

    def factor(step: int) -> float:
        asked.append(step)
        return warmup_cosine_factor(config, step)

    schedule = GlobalStepLR(fresh_optimizer(), lambda optimizer: LambdaLR(optimizer, factor))
    asked.clear()
    schedule.set_step(1_000_000)
    assert len(asked) <= 2 * len(schedule.optimizer.param_groups) + 2, len(asked)  # the rebuild, then one step
    assert asked[-1] == 1_000_000
    assert schedule.current_lrs() == [base * factor(1_000_000) for base in schedule.base_lrs]
    assert schedule.scheduler.last_epoch == 1_000_000
