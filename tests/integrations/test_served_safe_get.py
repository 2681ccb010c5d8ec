"""The served ``deepspeed.utils`` fp32 accessors (issue 41): ``safe_get_full_fp32_param``,
``safe_get_full_grad``, ``safe_get_full_optimizer_state``, their ``safe_set_*`` and ``*_local_*``
variants, at ZeRO-1, 2 and 3 on two gloo ranks, against one process training the same global
batches with ``torch.optim.AdamW`` from the same initial values (zero/full_values.py).

Gradient accumulation over two micro-steps: after the first backward ZeRO-2/3 hold half the
window's gradient (the first micro-batches' share) and ZeRO-1 refuses (its micro-steps are summed
unreduced inside the runtime); after the boundary's backward every stage holds the window's
gradient, which ``step()`` consumes. A frozen parameter has no master, hence None. A full write
then a forward computes with the written value; a write of optimizer state reads back. In fp16
the gradient comes unscaled. Before, every one of these names raised NotImplementedError."""

import pytest
import torch

from _harness.multiproc import require_world_size, run_distributed

WORLD = 2
STEPS, GAS, MICRO, LR = 2, 2, 2, 1e-2
# fp32 throughout; the only difference from the reference is the order of the sums (per-rank,
# per-micro-step gradients averaged by the reduction vs one backward over the global batch), a few
# ulps, which Adam's first steps (update ~ lr * m / sqrt(v)) do not amplify beyond that.
TOL = dict(rtol=1e-5, atol=1e-6)


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model[2].bias.requires_grad_(False)  # frozen: no master, no gradient, no optimizer state
    return model


def _batches():
    g = torch.Generator().manual_seed(5)
    n = STEPS * GAS
    return torch.randn(n, WORLD * MICRO, 6, generator=g), torch.randn(n, WORLD * MICRO, 3, generator=g)


def _reference():
    """Per step: the gradients of the first micro-step's share and of the whole window, the
    parameters before and after, Adam's state after."""
    model = _model()
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=LR, weight_decay=0.0)
    xs, ys = _batches()
    out = []
    for step in range(STEPS):
        record = {"before": [p.detach().clone() for p in model.parameters()]}
        opt.zero_grad()
        for micro in range(GAS):
            i = step * GAS + micro
            loss = torch.nn.functional.mse_loss(model(xs[i]), ys[i]) / GAS
            loss.backward()
            if micro == 0:
                record["first"] = [p.grad.clone() for p in trained]
        record["grad"] = [p.grad.clone() for p in trained]
        opt.step()
        record["after"] = [p.detach().clone() for p in model.parameters()]
        record["state"] = [{k: v.clone() for k, v in opt.state[p].items()} for p in trained]
        out.append(record)
    return out


def _close(got, want, what):
    assert got is not None, what
    torch.testing.assert_close(got.cpu(), want, **TOL, msg=lambda m: f"{what}: {m}")


def _train_and_check(ctx, stage, ref):
    from deepcompile.integrations import deepspeed_api as deepspeed
    from deepcompile.zero.sharding import GradientUnavailable

    u = deepspeed.utils
    model = _model()
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
              # ZeRO-3: every parameter stays gathered between forwards, so a write must make the
              # gathered copies stale.
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 10 ** 6},
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
              "compile": {"backend": "eager"}}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])
    params = list(model.parameters())
    trained, frozen = params[:3], params[3]
    xs, ys = (t.to(ctx.device) for t in _batches())
    mine = slice(ctx.rank * MICRO, (ctx.rank + 1) * MICRO)
    sharding = engine.engine.sharding

    for step in range(STEPS):
        want = ref[step]
        for p, w in zip(trained, want["before"]):
            _close(u.safe_get_full_fp32_param(p), w, f"ZeRO-{stage} fp32 before {step}")
        assert all(u.safe_get_full_grad(p) is None for p in params)  # no backward in this window yet
        for micro in range(GAS):
            i = step * GAS + micro
            engine.backward(torch.nn.functional.mse_loss(engine(xs[i, mine]), ys[i, mine]))
            if micro == 0 and stage == 1:
                with pytest.raises(GradientUnavailable, match="ZeRO-1 keeps the gradients"):
                    u.safe_get_full_grad(trained[0])
                with pytest.raises(GradientUnavailable, match="ZeRO-1"):
                    u.safe_get_local_grad(trained[0])
            elif micro == 0:  # ZeRO-2/3: what the window accumulated so far
                for p, w in zip(trained, want["first"]):
                    _close(u.safe_get_full_grad(p), w, f"ZeRO-{stage} accumulated grad {step}")
            if micro < GAS - 1:
                engine.step()  # a no-op between boundaries
        for p, w in zip(trained, want["grad"]):
            full = u.safe_get_full_grad(p)
            _close(full, w, f"ZeRO-{stage} grad {step}")
            shard = sharding.shard(sharding.ds_id_of[id(p)])
            _close(u.safe_get_local_grad(p), full.reshape(-1)[shard.start:shard.end].cpu(), "local grad")
        assert u.safe_get_full_grad(frozen) is None and u.safe_get_full_fp32_param(frozen) is None
        assert u.safe_get_full_optimizer_state(frozen, "exp_avg") is None
        engine.step()
        assert u.safe_get_full_grad(trained[0]) is None  # the step consumed it
        for p, w in zip(trained, want["after"]):
            _close(u.safe_get_full_fp32_param(p), w, f"ZeRO-{stage} fp32 after {step}")
        for p, w in zip(trained, want["state"]):
            for key in ("exp_avg", "exp_avg_sq"):
                _close(u.safe_get_full_optimizer_state(p, key), w[key], f"ZeRO-{stage} {key} {step}")
            assert float(u.safe_get_full_optimizer_state(p, "step")) == float(w["step"])
            shard = sharding.shard(sharding.ds_id_of[id(p)])
            local = u.safe_get_local_optimizer_state(p, "exp_avg")
            _close(local, w["exp_avg"].reshape(-1)[shard.start:shard.end], "local exp_avg")
        with pytest.raises(KeyError, match="momentum_buffer"):
            u.safe_get_full_optimizer_state(trained[0], "momentum_buffer")

    # Writes: a full fp32 value and a local piece, then a forward computes with them. A forward
    # first, so that ZeRO-3's persistent parameters are gathered when the writes come.
    weight, bias = trained[0], trained[1]
    x, last = xs[0, mine], ref[-1]["after"]

    def reference_forward(w0, b0):
        hidden = torch.tanh(torch.nn.functional.linear(x.cpu(), w0, b0))
        return torch.nn.functional.linear(hidden, last[2], last[3])

    with torch.no_grad():
        _close(engine(x), reference_forward(last[0], last[1]), f"ZeRO-{stage} forward after training")
    new_weight = torch.linspace(-1, 1, weight.numel()).view(weight.shape)
    u.safe_set_full_fp32_param(weight, new_weight.to(ctx.device))
    local = u.safe_get_local_fp32_param(bias)
    u.safe_set_local_fp32_param(bias, local * 2 + 1)
    new_bias = ref[-1]["after"][1] * 2 + 1
    _close(u.safe_get_full_fp32_param(weight), new_weight, "written weight")
    _close(u.safe_get_full_fp32_param(bias), new_bias, "written bias")
    with torch.no_grad():
        _close(engine(x), reference_forward(new_weight, new_bias), f"ZeRO-{stage} forward after the writes")
    # Optimizer state: a full write, a local write, read back.
    new_m = torch.full(weight.shape, 0.25)
    u.safe_set_full_optimizer_state(weight, new_m.to(ctx.device), "exp_avg")
    _close(u.safe_get_full_optimizer_state(weight, "exp_avg"), new_m, "written exp_avg")
    piece = u.safe_get_local_optimizer_state(bias, "exp_avg_sq")
    u.safe_set_local_optimizer_state(bias, piece + 3, "exp_avg_sq")
    _close(u.safe_get_full_optimizer_state(bias, "exp_avg_sq"), ref[-1]["state"][1]["exp_avg_sq"] + 3,
           "written exp_avg_sq")
    engine.destroy()
    with pytest.raises(RuntimeError, match="no live deepcompile engine"):
        u.safe_get_full_fp32_param(weight)


def _body(ctx):
    # The served package itself, not serve_as_deepspeed(): the pool's worker processes are shared
    # with tests that imported transformers already.
    from deepcompile.integrations import deepspeed_api as deepspeed
    from deepcompile.zero.sharding import GradientUnavailable

    with pytest.raises(RuntimeError, match="no live deepcompile engine"):
        deepspeed.utils.safe_get_full_grad(torch.nn.Parameter(torch.zeros(2)))
    ref = _reference()
    for stage in (1, 2, 3):
        _train_and_check(ctx, stage, ref)

    # fp16: the gradient comes without the loss scale (2 ** 8 here), in fp32.
    model = _model()
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
              "zero_optimization": {"stage": 2}, "fp16": {"enabled": True, "initial_scale_power": 8},
              "optimizer": {"type": "AdamW", "params": {"lr": LR}}, "compile": {"backend": "eager"}}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])
    xs, ys = (t.to(ctx.device) for t in _batches())
    mine = slice(ctx.rank * MICRO, (ctx.rank + 1) * MICRO)
    for micro in range(GAS):
        engine.backward(torch.nn.functional.mse_loss(engine(xs[micro, mine].half()).float(), ys[micro, mine]))
        if micro < GAS - 1:
            engine.step()
    for p, want in zip(list(model.parameters())[:3], ref[0]["grad"]):
        got = deepspeed.utils.safe_get_full_grad(p)
        assert got.dtype == torch.float32
        # fp16 parameters and activations against the fp32 reference: about 1e-3 relative; a
        # gradient still carrying the scale would be 256 times too large.
        torch.testing.assert_close(got.cpu(), want, rtol=2e-2, atol=2e-3)
    engine.step()
    engine.destroy()

    # compile.optimizer_step_in_backward consumes the gradients in the backward: refused, not None.
    model = _model()
    config = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": LR}},
              "compile": {"backend": "eager", "optimizer_step_in_backward": True}}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])
    xs, ys = (t.to(ctx.device) for t in _batches())
    engine.backward(torch.nn.functional.mse_loss(engine(xs[0, :MICRO]), ys[0, :MICRO]))
    with pytest.raises(GradientUnavailable, match="optimizer_step_in_backward"):
        deepspeed.utils.safe_get_full_grad(model[0].weight)
    engine.step()
    engine.destroy()


@pytest.mark.world_size(WORLD)
def test_served_fp32_accessors_match_one_process():
    require_world_size(WORLD)
    run_distributed(_body, world_size=WORLD)
