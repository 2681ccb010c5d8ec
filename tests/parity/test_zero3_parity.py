"""ZeRO-3 end to end: deepcompile training on 2 ranks against single-process training.

Each case compares the per-step losses, the global gradient norm of every optimizer step (before
clipping) and the full parameters after the last step. fp32: 1e-5 relative (Inductor cases 1e-4:
fused kernels sum in another order than the eager reference). bf16: the engine trains bf16
parameters (fp32 master weights, bf16 gradients reduced in bf16) against an fp32 reference, so it
is compared at 3e-2 relative / 3e-2 absolute after 4 steps; this tolerance bounds bf16 rounding.

A gradient of the wrong scale (doubled, unaveraged over ranks, summed over micro-steps) hardly
moves AdamW's parameters (its update m/sqrt(v) sees the scale only through eps), so the
parameters alone would pass it at these tolerances; the gradient norms, compared relatively
(assert_parity), are off by the factor itself. The core cases also run with SGD with momentum,
whose parameters move in proportion to the gradient.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from deepcompile import compat

from _harness.multiproc import run_distributed, single_world_size
from _harness.parity_cases import (GLOBAL_BATCH, RunResult, assert_parity, batch, build_model, make_optimizer, train_engine,
                          train_reference)

FP32_TOL = dict(rtol=1e-5, atol=1e-6)
# Inductor fuses and reorders float sums differently from the eager single-process reference.
INDUCTOR_TOL = dict(rtol=1e-4, atol=1e-5)
BF16_TOL = dict(rtol=3e-2, atol=3e-2)
WORLD = single_world_size()  # 2 (or DC_TEST_WORLD_SIZES), at most the GPU count
pytestmark = pytest.mark.world_size(WORLD)  # the world size in every test id (conftest.py)
# The clipping tests' limit: the MLP's gradient norms run 0.33 to 0.66 (one micro-step or four),
# so every step clips, by a factor of 0.4 to 0.75 (0.5 left some steps, and every accumulated
# window, unclipped). assert_clipping_binds checks it.
CLIP = 0.25


def zero3_config(**overrides):
    cfg = {
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 64, "stage3_param_persistence_threshold": 10},
        "gradient_accumulation_steps": 1,
    }
    for key, value in overrides.items():
        if key in ("reduce_bucket_size", "stage3_param_persistence_threshold"):
            cfg["zero_optimization"][key] = value
        else:
            cfg[key] = value
    return cfg


def assert_clipping_binds(result: RunResult, clip: float) -> None:
    """A clipping test clips: the norm before clipping exceeds the limit at every optimizer step
    (a limit above the norms would leave the gradients as they are, and pass with clipping
    broken)."""
    assert result.grad_norms and min(result.grad_norms) > clip, \
        f"clipping at {clip} does not bind at every step; norms before clipping: {result.grad_norms}"


def _parity_body(ctx, name, backend, steps, config, bf16=False, torch_compile_api=False, expect_eager=None,
                 eager_only_in=None, optimizer="adamw", tol=None):
    dtype = torch.bfloat16 if bf16 else torch.float32
    got, engine = train_engine(name, steps, config, backend, ctx.device, dtype=dtype,
                               use_torch_compile_api=torch_compile_api, optimizer=optimizer)
    clip = config.get("gradient_clipping", 0.0)
    ref = train_reference(name, steps, gas=config.get("gradient_accumulation_steps", 1), clip=clip,
                          device=ctx.device, optimizer=optimizer)
    if tol is None:
        tol = BF16_TOL if bf16 else INDUCTOR_TOL if backend == "inductor" else FP32_TOL
    assert_parity(got, ref, **tol)
    if clip > 0:
        assert_clipping_binds(got, clip)
    eager = engine.eagerly_gathered_params()
    if os.environ.get("DC_TEST_REGIONAL") == "1" and any(".layers." in n for n in got.params):
        # Compiled layer by layer: what lies outside the layers (embedding, norm, head) runs
        # eagerly by design; the expectations are about the layers.
        eager = [n for n in eager if ".layers." in n]
    if expect_eager is True:
        assert eager, "the eager fallback gathered nothing although a frame ran eagerly"
    elif expect_eager is False:
        assert not eager, f"parameters were gathered eagerly in a fully compiled model: {eager}"
    if eager_only_in is not None:
        outside = [n for n in eager if eager_only_in not in n]
        assert not outside, f"parameters outside {eager_only_in!r} were gathered eagerly: {outside}"
    engine.destroy()


@pytest.mark.parametrize(
    "name,backend,expect_eager",
    [
        ("mlp", None, True),  # the engine without compile(): everything eager
        ("mlp", "eager", False),
        ("mlp", "inductor", False),
        ("graph_break", "eager", False),
        ("disabled_forward", "eager", True),
        ("partly_disabled", "eager", True),
        ("tied", "eager", False),
        ("lora", "eager", False),
        ("llama", "eager", False),
        ("llama", "inductor", False),
        # A parameter view returned by one graph and used after a break: a copy of the gathered value.
        ("view_across_break", "eager", False),
        # Each half of a broken block's forward is compiled once and called for every block.
        # (torch 2.11 runs the frame with the block loop eagerly: the head is gathered eagerly there.)
        ("repeated_broken_blocks", "eager", None),
    ],
)
def test_zero3_parity(name, backend, expect_eager):
    run_distributed(_parity_body, WORLD, args=(name, backend, 4, zero3_config()), kwargs={"expect_eager": expect_eager},
                    timeout=600)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_zero3_qwen2_moe(backend):
    """transformers' Qwen2-MoE, nothing persistent. Under Inductor its expert kernel (a custom op
    that needs exact input strides) used to read a copy of the traced stride-0 placeholder layout:
    one element of each gathered expert weight, a wrong loss from the first step.

    With transformers versions whose expert kernel has a data-dependent backward (5.17: the
    graph cannot be compiled and Dynamo runs the kernel eagerly) the expert modules must become
    leaves gathered eagerly (and only they); with versions that trace one graph nothing is
    gathered eagerly. Both must train like the single-process reference. (torch 2.11 runs some
    frames with loops eagerly, and the embedding called from them.)"""
    cfg = zero3_config(stage3_param_persistence_threshold=0)
    only = ".experts." if compat.TORCH_VERSION >= (2, 12) else None
    run_distributed(_parity_body, WORLD, args=("qwen2_moe", backend, 4, cfg), kwargs={"eager_only_in": only},
                    timeout=900)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_zero3_custom_op_that_cannot_be_compiled(backend):
    """An expert kernel as a custom op whose backward reads its offsets on the host: no graph
    containing it compiles, and Dynamo would run it eagerly on placeholder weights (NaN). The
    expert modules become leaves; the first call, already inside such a module, runs its resumed
    graph eagerly with gathered weights. Only expert weights are gathered eagerly (torch 2.11
    also runs the frame with the layer loop eagerly, and the Linear layers called from it)."""
    cfg = zero3_config(stage3_param_persistence_threshold=0)
    only = ".experts." if compat.TORCH_VERSION >= (2, 12) else None
    run_distributed(_parity_body, WORLD, args=("custom_op_experts", backend, 4, cfg),
                    kwargs={"eager_only_in": only, "expect_eager": True}, timeout=600)


def _forwards_without_backward_body(ctx, name, backend):
    """Forwards whose backward never runs (an evaluation under no_grad, a training forward whose
    loss is dropped) between training steps: training still matches the reference and nothing
    stays gathered. DeepSpeed pairs forward and backward graphs by patching autograd's compiled
    function and assumes every forward is followed by its backward."""
    import deepcompile
    from deepcompile import runtime

    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(name, device=ctx.device)
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()), zero3_config())
    engine.compile(backend=backend)
    n = GLOBAL_BATCH // world
    losses, norms = [], []
    for step in range(4):
        a, b = batch(name, step, device=ctx.device)
        a, b = a[rank * n : (rank + 1) * n], b[rank * n : (rank + 1) * n]
        with torch.no_grad():
            engine(a, b)
        engine(a, b)  # abandoned: its graph and saved tensors are dropped unused
        gathered = [sp.name for sp in engine.sharding.params if not sp.persistent and runtime.is_gathered(sp.ds_id)]
        assert not gathered, f"step {step}: still gathered after forwards without backward: {gathered}"
        loss = engine(a, b)
        engine.backward(loss)
        norms.append(engine.step().item())
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    got = RunResult(losses, {k: v.float() for k, v in engine.full_state_dict(all_ranks=True).items()}, norms)
    ref = train_reference(name, 4, device=ctx.device)
    assert_parity(got, ref, **(INDUCTOR_TOL if backend == "inductor" else FP32_TOL))
    engine.destroy()


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_zero3_forwards_without_backward(backend):
    run_distributed(_forwards_without_backward_body, WORLD, args=("mlp", backend), timeout=600)


def test_zero3_seed002_disabled_forward_with_zero_persistence():
    """A forward under torch.compiler.disable (Dynamo skips the frame, nothing is compiled) with
    persistence threshold 0: the eager fallback gathers every parameter, and training matches
    single-process training."""
    cfg = zero3_config(stage3_param_persistence_threshold=0)
    run_distributed(_parity_body, WORLD, args=("disabled_forward", "eager", 4, cfg), kwargs={"expect_eager": True})


def test_zero3_gradient_accumulation():
    """Three windows of 4 micro-steps; every window after the first starts after an update."""
    cfg = zero3_config(gradient_accumulation_steps=4)
    run_distributed(_parity_body, WORLD, args=("mlp", "eager", 12, cfg))


def test_zero3_gradient_clipping():
    cfg = zero3_config(gradient_clipping=CLIP)
    run_distributed(_parity_body, WORLD, args=("mlp", "eager", 6, cfg))


def test_zero3_gradient_accumulation_and_clipping():
    cfg = zero3_config(gradient_accumulation_steps=4, gradient_clipping=CLIP)
    run_distributed(_parity_body, WORLD, args=("mlp", "eager", 12, cfg))


# SGD with momentum: an update proportional to the gradient, so a gradient scaled wrongly (an
# unaveraged or doubled reduction, micro-steps summed, clipping that does not bind) moves the
# parameters by the wrong amount, where AdamW's update would hide it.
SGD_CASES = {
    "plain": zero3_config(),
    "accumulation": zero3_config(gradient_accumulation_steps=4),
    "clipping": zero3_config(gradient_clipping=CLIP),
}


@pytest.mark.parametrize("case", sorted(SGD_CASES))
def test_zero3_sgd_momentum(case):
    steps = 8 if case == "accumulation" else 4
    run_distributed(_parity_body, WORLD, args=("mlp", "eager", steps, SGD_CASES[case]),
                    kwargs={"optimizer": "sgd_momentum"})


def test_zero3_bf16():
    cfg = zero3_config(bf16={"enabled": True})
    run_distributed(_parity_body, WORLD, args=("mlp", "eager", 4, cfg), kwargs={"bf16": True})


# bf16 with SGD with momentum against the fp32 single-process reference, gradient norms included
# (issue 39, item 8). test_zero3_bf16's AdamW, at BF16_TOL, passes a doubled applied gradient and
# test_communication_data_type_bf16_zero3 compares two deepcompile runs, so a sum instead of a
# mean passes both; here a factor 2 moves every SGD update and the norm by 100%.
#
# The tolerances, from bf16's 8 significant bits: one rounding is off by at most 2^-9 (to nearest),
# about 4e-3 (2^-8) per ulp.
# * fp32 parameters, gradients reduce-scattered in bf16: the fp32 gradients are rounded once into
#   the bf16 partition and the sum once more, so each reduced element, and the global norm, is off
#   by up to ~2 roundings (<= 4e-3; 2.5e-3 seen). rtol 1e-2 bounds that with a margin of 2.5.
#   The first loss is exact and later ones differ by the parameters only (4e-7 seen). The
#   parameters after 3 SGD steps (lr 0.05, momentum 0.9: weights 1 + 1.9 + 2.71 = 5.6 on the
#   gradients) differ by at most 0.05 * 5.6 * |g| (<= 0.3) * 4e-3 ~ 3e-4: atol 1e-3 (9e-5 seen). A
#   doubled gradient moves them by another 0.05 * 5.6 * |g|, ~3e-2 at |g| = 0.1.
# * bf16 parameters (fp32 masters): the forward and backward round every matmul output, so the
#   gradients carry a few roundings (norms off by up to 5e-3 seen: rtol 2e-2), and the gathered
#   parameters are bf16, off the fp32 reference by up to half an ulp: 2^-9 relative (inside
#   rtol), 1.9e-3 seen at |p| ~ 1; atol 2e-3 for the small parameters whose trajectory differs.
BF16_COMM_TOL = dict(rtol=1e-2, atol=1e-3)
BF16_PARAMS_SGD_TOL = dict(rtol=2e-2, atol=2e-3)
BF16_SGD_CASES = {
    "fp32_params-bf16_comm": (zero3_config(communication_data_type="bf16"), False, BF16_COMM_TOL),
    "bf16_params": (zero3_config(bf16={"enabled": True}), True, BF16_PARAMS_SGD_TOL),
    "bf16_params-bf16_comm": (zero3_config(bf16={"enabled": True}, communication_data_type="bf16"), True,
                              BF16_PARAMS_SGD_TOL),
}


@pytest.mark.parametrize("case", list(BF16_SGD_CASES))
def test_zero3_bf16_sgd_momentum(case):
    cfg, bf16, tol = BF16_SGD_CASES[case]
    run_distributed(_parity_body, WORLD, args=("mlp", "eager", 3, cfg),
                    kwargs={"bf16": bf16, "optimizer": "sgd_momentum", "tol": tol})


def test_zero3_torch_compile_backend_name():
    """torch.compile(engine.module, backend="deepcompile") works like engine.compile()."""
    run_distributed(_parity_body, WORLD, args=("mlp", "eager", 3, zero3_config()),
                    kwargs={"torch_compile_api": True, "expect_eager": False})


def test_initialize_rejects_bad_config_before_touching_the_model():
    import deepcompile

    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"zero_optimization\.stgae"):
        deepcompile.initialize(model, opt, {"zero_optimization": {"stgae": 3}})
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps"):
        deepcompile.initialize(model, opt, {"zero_optimization": {"stage": 3}, "gradient_accumulation_steps": 0})
    assert model.weight.numel() == 9 and torch.isfinite(model.weight).all()  # untouched


class _FailingOnce(torch.nn.Module):
    """A linear layer owning its parameters, whose forward raises once after they were gathered."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(5, 7) * 0.3)
        self.bias = torch.nn.Parameter(torch.zeros(5))
        self.fail = False

    def forward(self, x, y):
        out = torch.nn.functional.linear(x, self.weight, self.bias)
        if self.fail:
            self.fail = False
            raise RuntimeError("injected failure")
        return ((out - y) ** 2).mean()


def _failed_forward_body(ctx):
    """Eager ZeRO-3 (no compile): the gather hook swaps gathered copies in, and its partner hook,
    which puts the partitioned parameters back, runs even when the forward raises, so the next
    step trains on the real parameters, not a stale copy."""
    import deepcompile

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _FailingOnce().to(ctx.device)
    reference = _FailingOnce().to(ctx.device)
    reference.load_state_dict(model.state_dict())
    engine = deepcompile.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), zero3_config())
    placeholders = dict(model.named_parameters())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    n = GLOBAL_BATCH // world
    for step in range(3):
        x, y = batch("mlp", step, device=ctx.device)
        if step == 1:
            model.fail = True
            with pytest.raises(RuntimeError, match="injected failure"):
                engine(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])
            for name, p in model.named_parameters():
                assert p is placeholders[name], f"{name}: a gathered copy was left in the module after the failure"
        loss = engine(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])
        engine.backward(loss)
        engine.step()
        ref_loss = reference(x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        torch.testing.assert_close(total.item() / world, ref_loss.item(), **FP32_TOL)
    engine.destroy()


def test_zero3_forward_that_raises_leaves_no_gathered_copy():
    run_distributed(_failed_forward_body, WORLD, timeout=300)
