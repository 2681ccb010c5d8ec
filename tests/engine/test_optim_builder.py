"""Optimizers and learning-rate schedules built from the config's ``optimizer`` / ``scheduler``
sections (``deepcompile.optim_builder``): the schedules' curves against DeepSpeed's formulas at
chosen steps, the optimizer mapping, the choice between objects and sections, and, on 2 gloo ranks,
an engine whose optimizer comes from the config against one given a hand-built torch optimizer.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from deepcompile.config import Config
from deepcompile.optim_builder import (
    WarmupSchedule,
    build_optimizer,
    build_scheduler,
    configure_optimizer,
    configure_scheduler,
)
from _harness.multiproc import run_distributed

WORLD = 2
pytestmark = pytest.mark.world_size(WORLD)  # the world size in every test id (conftest.py)


def _sched_config(kind, **params):
    return Config.from_any({"zero_optimization": {"stage": 3}, "scheduler": {"type": kind, "params": params}})


def _curve(kind, steps, lrs=(0.1,), **params):
    """The learning rates of optimizer steps 0..steps-1, stepping as the engine does."""
    groups = [{"params": [nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs]
    opt = torch.optim.SGD(groups, lr=lrs[0])
    sched = build_scheduler(_sched_config(kind, **params).scheduler, opt)
    assert isinstance(sched, torch.optim.lr_scheduler.LRScheduler)
    out = []
    for _ in range(steps):
        out.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    return out


# ---- curves: step t runs with DeepSpeed's value for iteration i = t - 1 (i = -1 at construction)


def test_warmup_lr_log():
    lo, hi, W = 0.001, 0.01, 10
    lr = [c[0] for c in _curve("WarmupLR", 60, warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=W)]
    assert lr[0] == pytest.approx(lo)  # i = -1: DeepSpeed starts at the minimum
    assert lr[1] == pytest.approx(lo)  # i = 0: log(1) = 0
    assert lr[2] == pytest.approx(lo + (hi - lo) * math.log(2) / math.log(10))
    assert lr[5] == pytest.approx(lo + (hi - lo) * math.log(5) / math.log(10))
    assert lr[10] == pytest.approx(hi)  # i = 9: log(10) / log(10)
    assert lr[11] == lr[59] == pytest.approx(hi)  # constant after the warm-up


def test_warmup_lr_linear_and_defaults():
    lr = [c[0] for c in _curve("WarmupLR", 8, warmup_max_lr=0.02, warmup_num_steps=4, warmup_type="linear")]
    assert lr[:6] == pytest.approx([0.0, 0.0, 0.005, 0.01, 0.015, 0.02])
    # warmup_max_lr default (and "auto"): the optimizer's learning rate; warmup_num_steps 1 acts as 2
    for max_lr in ({}, {"warmup_max_lr": "auto"}):
        lr = [c[0] for c in _curve("WarmupLR", 4, lrs=(0.3,), warmup_num_steps=1, warmup_type="linear", **max_lr)]
        assert lr == pytest.approx([0.0, 0.0, 0.15, 0.3])


def test_warmup_decay_lr():
    lo, hi = 0.001, 0.011
    lr = [c[0] for c in _curve("WarmupDecayLR", 21, warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=4,
                               total_num_steps=12, warmup_type="linear")]
    assert lr[3] == pytest.approx(lo + (hi - lo) * 2 / 4)  # warm-up, i = 2
    assert lr[5] == pytest.approx(hi)  # i = 4: (12 - 4) / (12 - 4) = 1
    assert lr[9] == pytest.approx(lo + (hi - lo) * 4 / 8)  # i = 8: (12 - 8) / 8
    assert lr[13] == pytest.approx(lo)  # i = 12 = total: decayed to the minimum
    assert lr[20] == pytest.approx(lo)  # and clamped there
    # DeepSpeed's default warmup_max_lr for WarmupDecayLR is 0.001, not the optimizer's lr
    lr = [c[0] for c in _curve("WarmupDecayLR", 4, lrs=(0.5,), warmup_num_steps=2, total_num_steps=10)]
    assert lr[2] == pytest.approx(0.001)


def test_warmup_cosine_lr():
    base, W, T, m, c = 0.1, 5, 25, 0.1, 0.01
    lr = [x[0] for x in _curve("WarmupCosineLR", 41, lrs=(base,), warmup_num_steps=W, total_num_steps=T,
                               warmup_min_ratio=m, cos_min_ratio=c, warmup_type="linear")]
    assert lr[0] == 0.0  # i = -1: DeepSpeed's ratio is 0 before the first step
    assert lr[1] == pytest.approx(base * m)  # i = 0
    assert lr[3] == pytest.approx(base * (m + (1 - m) * 2 / 5))
    p = 1 / 20  # i = 5: (5 - 5 + 1) / (25 - 5)
    assert lr[6] == pytest.approx(base * (c + (1 - c) * (1 + math.cos(math.pi * p)) / 2))
    assert lr[15] == pytest.approx(base * (c + (1 - c) * (1 + math.cos(math.pi * 10 / 20)) / 2))
    assert lr[25] == pytest.approx(base * c)  # i = 24: p = 1
    assert lr[40] == pytest.approx(base * c)  # clamped
    # log warm-up, DeepSpeed's defaults for the ratios (0 and 1e-4)
    lr = [x[0] for x in _curve("WarmupCosineLR", 4, lrs=(0.2,), warmup_num_steps=100, total_num_steps=200)]
    assert lr[2] == pytest.approx(0.2 * math.log(2) / math.log(100))


def test_per_group_learning_rates():
    out = _curve("WarmupLR", 4, lrs=(0.1, 0.4), warmup_min_lr=[0.0, 0.1], warmup_num_steps=2,
                 warmup_type="linear")
    assert out[0] == pytest.approx([0.0, 0.1])
    assert out[3] == pytest.approx([0.1, 0.4])  # "max": each group's own lr
    with pytest.raises(ValueError, match="2 values for 1 optimizer param groups"):
        _curve("WarmupLR", 1, warmup_min_lr=[0.0, 0.1])


def test_schedule_state_dict_round_trip():
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    cfg = _sched_config("WarmupDecayLR", warmup_num_steps=3, total_num_steps=9).scheduler
    s = build_scheduler(cfg, opt)
    for _ in range(4):
        opt.step()
        s.step()
    s2 = build_scheduler(cfg, torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1))
    s2.load_state_dict(s.state_dict())
    assert s2.last_epoch == 4 and s2.get_last_lr() == s.get_last_lr()


# ---- optimizer mapping


def _params():
    return [nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(2))]


@pytest.mark.parametrize(
    "section, cls, expected",
    [
        ({"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.1}}, torch.optim.AdamW,
         {"lr": 0.01, "weight_decay": 0.1, "betas": (0.9, 0.999), "eps": 1e-8, "amsgrad": False}),
        ({"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.1, "adam_w_mode": False}}, torch.optim.Adam,
         {"weight_decay": 0.1}),
        ({"type": "ADAMW", "params": {"betas": [0.8, 0.9], "eps": 1e-6, "amsgrad": True, "torch_adam": True}},
         torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.0, "betas": (0.8, 0.9), "eps": 1e-6, "amsgrad": True}),
        ({"type": "SGD", "params": {"lr": 0.2, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-4}},
         torch.optim.SGD, {"lr": 0.2, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-4, "dampening": 0.0}),
    ],
)
def test_build_optimizer(section, cls, expected):
    cfg = Config.from_any({"zero_optimization": {"stage": 1}, "optimizer": section})
    opt = build_optimizer(cfg.optimizer, _params())
    assert type(opt) is cls
    for k, v in expected.items():
        assert opt.defaults[k] == v, k


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)


def test_configure_optimizer_choices():
    with_section = Config.from_any({"zero_optimization": {"stage": 1}, "optimizer": {"type": "SGD"}})
    without = Config.from_any({"zero_optimization": {"stage": 1}})
    m = _Tiny()
    opt = configure_optimizer(m, None, with_section)
    assert [len(g["params"]) for g in opt.param_groups] == [2]  # trainable parameters only
    groups = [{"params": [m.a.weight], "lr": 0.5}, {"params": [m.a.bias]}]
    opt = configure_optimizer(m, None, with_section, model_parameters=groups)
    assert [g["lr"] for g in opt.param_groups] == [0.5, 1e-3]
    with pytest.raises(ValueError, match="got an optimizer and the config has an 'optimizer' section"):
        configure_optimizer(m, torch.optim.SGD(m.a.parameters()), with_section)
    with pytest.raises(ValueError, match="needs an optimizer"):
        configure_optimizer(m, None, without)
    # a callable taking the parameters, as DeepSpeed accepts
    opt = configure_optimizer(m, lambda ps: torch.optim.AdamW(ps, lr=0.3), without)
    assert type(opt) is torch.optim.AdamW and opt.defaults["lr"] == 0.3
    with pytest.raises(TypeError, match="returned int"):
        configure_optimizer(m, lambda ps: 3, without)


def test_untested_optimizer_gate():
    m = _Tiny()
    strict = Config.from_any({"zero_optimization": {"stage": 1}})
    with pytest.raises(ValueError, match=r"torch.optim.adagrad.Adagrad is not one .*zero_allow_untested_optimizer"):
        configure_optimizer(m, torch.optim.Adagrad(m.a.parameters()), strict)

    class MyAdam(torch.optim.AdamW):  # exact types, as DeepSpeed: a subclass counts as untested
        pass

    with pytest.raises(ValueError, match="zero_allow_untested_optimizer"):
        configure_optimizer(m, MyAdam(m.a.parameters()), strict)
    relaxed = Config.from_any({"zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True})
    assert type(configure_optimizer(m, torch.optim.Adagrad(m.a.parameters()), relaxed)) is torch.optim.Adagrad
    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
        configure_optimizer(m, cls(m.a.parameters(), lr=0.1), strict)


def test_configure_scheduler_choices():
    opt = torch.optim.SGD(_params(), lr=0.1)
    with_section = _sched_config("WarmupLR")
    without = Config.from_any({"zero_optimization": {"stage": 3}})
    assert isinstance(configure_scheduler(opt, with_section), WarmupSchedule)
    assert configure_scheduler(opt, without) is None
    own = torch.optim.lr_scheduler.StepLR(opt, 2)
    with pytest.raises(ValueError, match="got an lr_scheduler and the config has a 'scheduler' section"):
        configure_scheduler(opt, with_section, own)
    assert configure_scheduler(opt, without, own) is own
    made = configure_scheduler(opt, without, lambda o: torch.optim.lr_scheduler.StepLR(o, 3))
    assert made.optimizer is opt and made.step_size == 3
    other = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(_params(), lr=0.1), 2)
    with pytest.raises(ValueError, match="drives another optimizer"):
        configure_scheduler(opt, without, other)


# ---- on 2 ranks: config-built optimizer == hand-built torch optimizer


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(7, 13)
        self.fc2 = nn.Linear(13, 5)

    def forward(self, x, y):
        return ((self.fc2(torch.tanh(self.fc1(x))) - y) ** 2).mean()


def _batch(step, rank, n=3):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 7, generator=g), torch.randn(n, 5, generator=g)


def _train(ctx, cfg, optimizer_factory, steps, gas):
    import deepcompile

    torch.manual_seed(0)
    model = _MLP().to(ctx.device)
    opt = optimizer_factory(model) if optimizer_factory is not None else None
    engine = deepcompile.initialize(model, opt, cfg)
    lrs = []
    for step in range(steps * gas):
        x, y = (t.to(ctx.device) for t in _batch(step, ctx.rank))
        engine.backward(engine(x, y))
        engine.step()
        if engine.micro_steps % gas == 0:  # the step just taken ended a window
            lrs.append(engine.get_lr())
    assert engine.global_steps == steps
    state = engine.full_state_dict(all_ranks=True)
    kind = type(engine.basic_optimizer)
    engine.destroy()
    return state, lrs, kind


HAND_BUILT = {
    "Adam": lambda m, hp: torch.optim.AdamW(m.parameters(), lr=hp["lr"], betas=hp["betas"], eps=hp["eps"],
                                            weight_decay=hp["weight_decay"]),
    "Adam-l2": lambda m, hp: torch.optim.Adam(m.parameters(), lr=hp["lr"], betas=hp["betas"], eps=hp["eps"],
                                              weight_decay=hp["weight_decay"]),
    "AdamW-amsgrad": lambda m, hp: torch.optim.AdamW(m.parameters(), lr=hp["lr"], betas=hp["betas"], eps=hp["eps"],
                                                     weight_decay=hp["weight_decay"], amsgrad=True),
    "SGD": lambda m, hp: torch.optim.SGD(m.parameters(), lr=hp["lr"], momentum=hp["momentum"],
                                         nesterov=hp["nesterov"], weight_decay=hp["weight_decay"]),
}
SECTIONS = {
    "Adam": {"type": "Adam", "params": {"lr": 0.05, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1}},
    "Adam-l2": {"type": "Adam", "params": {"lr": 0.05, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1,
                                           "adam_w_mode": False}},
    "AdamW-amsgrad": {"type": "AdamW", "params": {"lr": 0.05, "betas": [0.8, 0.99], "eps": 1e-6,
                                                  "weight_decay": 0.1, "amsgrad": True}},
    "SGD": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}},
}
EXPECTED_CLASS = {"Adam": torch.optim.AdamW, "Adam-l2": torch.optim.Adam, "AdamW-amsgrad": torch.optim.AdamW,
                  "SGD": torch.optim.SGD}


def _hand_built(name, section):
    hp = Config.from_any({"zero_optimization": {"stage": 1}, "optimizer": section}).optimizer.params_dict()
    return lambda model: HAND_BUILT[name](model, hp)


def _parity_body(ctx, name, stage, gas):
    steps = 4
    scheduler = {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2, "total_num_steps": 5,
                                                     "warmup_max_lr": "auto", "warmup_type": "linear"}}
    base = {"zero_optimization": {"stage": stage}, "gradient_accumulation_steps": gas, "scheduler": scheduler,
            "gradient_clipping": 1.0}
    got, got_lrs, kind = _train(ctx, {**base, "optimizer": SECTIONS[name]}, None, steps, gas)
    assert kind is EXPECTED_CLASS[name]
    ref, ref_lrs, _ = _train(ctx, base, _hand_built(name, SECTIONS[name]), steps, gas)
    # The same updates: bit for bit (same torch optimizer, same order of operations).
    for k in ref:
        assert torch.equal(got[k], ref[k]), (k, (got[k] - ref[k]).abs().max())
    lr = 0.05  # WarmupDecayLR, W = 2, T = 5, linear, after optimizer steps 1..4 (i = 0..3)
    assert got_lrs == ref_lrs == [[0.0], [lr * 0.5], [lr], [lr * 2 / 3]], got_lrs
    # and the model did train
    torch.manual_seed(0)
    init = _MLP().state_dict()
    assert not torch.equal(got["fc1.weight"], init["fc1.weight"])


@pytest.mark.parametrize(
    "name,stage,gas",
    [("Adam", 3, 1), ("Adam-l2", 1, 2), ("AdamW-amsgrad", 2, 1), ("SGD", 3, 2)],
)
def test_config_optimizer_matches_hand_built(name, stage, gas):
    run_distributed(_parity_body, WORLD, args=(name, stage, gas), timeout=300)


def _client_scheduler_body(ctx, stage):
    """A scheduler passed to initialize (object or callable) is stepped once per optimizer step."""
    import deepcompile

    for how in ("object", "callable"):
        torch.manual_seed(0)
        model = _MLP().to(ctx.device)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.5 ** t) if how == "object" else \
            (lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda t: 0.5 ** t))
        engine = deepcompile.initialize(model, opt, {"zero_optimization": {"stage": stage},
                                                     "gradient_accumulation_steps": 2}, lr_scheduler=sched)
        assert engine.lr_scheduler.optimizer is engine.basic_optimizer
        seen = []
        for step in range(6):
            x, y = _batch(step, ctx.rank)
            engine.backward(engine(x.to(ctx.device), y.to(ctx.device)))
            engine.step()
            seen.append(engine.get_lr()[0])
        assert seen == [1.0, 0.5, 0.5, 0.25, 0.25, 0.125], (how, seen)
        engine.destroy()


@pytest.mark.parametrize("stage", [1, 3])
def test_client_lr_scheduler_steps_per_optimizer_step(stage):
    run_distributed(_client_scheduler_body, WORLD, args=(stage,), timeout=300)
