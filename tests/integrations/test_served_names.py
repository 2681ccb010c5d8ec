"""The names training programs import or call at startup from the served ``deepspeed``
(issue 41's import-time names): each works, or imports and refuses when called with a message
saying what to use instead.

Who uses them: DeepSpeed-Chat and DeepSpeedExamples (``add_config_arguments``, the top-level
``get_accelerator`` and its device/seed/memory calls, ``compression.helper``), Lightning's
DeepSpeed strategy (``utils.logging.logger``, ``runtime.base_optimizer.DeepSpeedOptimizer``,
``checkpointing.configure``), mmengine/xtuner (``ops.lamb.FusedLamb``, ``runtime.fp16.onebit.*``),
open-instruct (``runtime.engine.DeepSpeedEngine``), OpenRLHF / open-instruct (``comm`` extras),
peft's AdaLoRA (``utils.safe_get_full_grad``).

``serve_as_deepspeed()`` rewrites ``sys.modules`` for the life of a process, so the probes below
run in one served child process (``_probe_*``, executed there from this very file), each caught on
its own; every test reads its probe's outcome. The child sees no GPU: the CPU meanings are tested.
"""

from __future__ import annotations


import pytest

from _harness import hf_launch, served_probes


# ---- probes: run in the served child process ------------------------------------------------


def _probe_deepspeed_chat_arguments_and_accelerator():
    import argparse

    import torch

    import deepspeed

    # DeepSpeed-Chat: parser = deepspeed.add_config_arguments(parser); args = parser.parse_args()
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    assert deepspeed.add_config_arguments(parser) is parser
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json", "--local_rank", "0"])
    assert (args.deepspeed, args.deepspeed_config, args.local_rank) == (True, "ds.json", 0)
    args = parser.parse_args([])
    assert (args.deepspeed, args.deepspeed_config) == (False, None)

    from deepspeed.accelerator import get_accelerator

    acc = deepspeed.get_accelerator()
    assert acc is get_accelerator()
    assert acc.device_name() == acc.current_device_name() == "cpu"
    assert acc.communication_backend_name() == "gloo"
    assert acc.is_available() and acc.is_bf16_supported() and acc.is_fp16_supported()
    assert acc.device_count() == 2  # LOCAL_WORLD_SIZE: one host "device" per local rank
    device = torch.device(acc.device_name(), 0)  # what DeepSpeed-Chat builds from local_rank
    assert device.type == "cpu"
    acc.set_device(0)
    acc.synchronize()
    acc.empty_cache()
    acc.manual_seed_all(7)
    first = torch.randn(3)
    acc.manual_seed(7)
    assert torch.equal(first, torch.randn(3))
    acc.reset_peak_memory_stats()
    allocated = acc.memory_allocated()
    assert 0 < allocated <= acc.max_memory_allocated()
    assert 0 < acc.available_memory() <= acc.total_memory()


def _probe_lightning_logging_and_optimizer_base():
    import io
    import logging

    import deepspeed
    from deepspeed.utils.logging import LoggerFactory, log_dist, logger, should_log_le

    from deepcompile.integrations.deepspeed_api.engine import OptimizerView

    # Lightning's DeepSpeedStrategy.__init__: deepspeed.utils.logging.logger.setLevel(level)
    deepspeed.utils.logging.logger.setLevel(logging.WARN)
    assert logger is deepspeed.utils.logging.logger is deepspeed.utils.logger
    assert not should_log_le("info") and should_log_le("warning") and should_log_le("ERROR")

    seen = io.StringIO()
    handler = logging.StreamHandler(seen)
    logger.addHandler(handler)
    log_dist("before any process group", ranks=[0], level=logging.WARNING)
    log_dist("below the level", ranks=[0], level=logging.INFO)
    logger.removeHandler(handler)
    assert seen.getvalue() == "before any process group\n"

    made = LoggerFactory.create_logger(name="served-names-probe", level=logging.INFO)
    assert made.level == logging.INFO and not made.propagate and made.handlers

    # Lightning's load_checkpoint: isinstance(item, (Optimizer, DeepSpeedOptimizer)) on the
    # optimizer deepspeed.initialize returned.
    from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer, ZeROOptimizer

    assert issubclass(OptimizerView, DeepSpeedOptimizer) and issubclass(OptimizerView, ZeROOptimizer)
    assert not issubclass(int, DeepSpeedOptimizer)


def _probe_checkpointing():
    import torch

    import deepspeed
    import deepspeed.checkpointing as checkpointing
    from deepspeed.checkpointing import checkpoint

    assert deepspeed.checkpointing is checkpointing and not checkpointing.is_configured()
    # Lightning's call with its default config: every option present and switched off.
    checkpointing.configure(mpu_=None, partition_activations=False, contiguous_checkpointing=False,
                            checkpoint_in_cpu=False, profile=None)
    assert checkpointing.is_configured()

    refusals = [
        dict(mpu_=object()),
        dict(mpu_=None, partition_activations=True),
        dict(mpu_=None, checkpoint_in_cpu=True),
        dict(mpu_=None, deepspeed_config={"activation_checkpointing": {"contiguous_memory_optimization": True}}),
    ]
    for kwargs in refusals:
        try:
            checkpointing.configure(**kwargs)
        except NotImplementedError as e:
            assert str(e).startswith("deepcompile does not implement deepspeed.checkpointing.configure("), e
        else:
            raise AssertionError(f"configure({kwargs}) was accepted")
    # An explicit argument overrides the config's section, as in DeepSpeed.
    checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": True}},
                            checkpoint_in_cpu=False)

    # checkpoint(fn, *args): the same values and gradients as the plain call, parameters included
    # when no input requires grad.
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    plain = layer(x).tanh().sum()
    plain.backward()
    expected = layer.weight.grad.clone()
    layer.weight.grad = None
    recomputed = checkpoint(lambda t: layer(t).tanh(), x).sum()
    recomputed.backward()
    assert torch.equal(plain, recomputed) and torch.allclose(layer.weight.grad, expected)


def _probe_refused_optimizers():
    import torch

    from deepspeed.ops.lamb import FusedLamb
    from deepspeed.runtime.fp16.onebit import OnebitAdam, OnebitLamb, ZeroOneAdam
    from deepspeed.runtime.fp16.onebit.adam import OnebitAdam as adam_module_class
    from deepspeed.runtime.fp16.onebit.lamb import OnebitLamb as lamb_module_class
    from deepspeed.runtime.fp16.onebit.zoadam import ZeroOneAdam as zoadam_module_class

    assert (adam_module_class, lamb_module_class, zoadam_module_class) == (OnebitAdam, OnebitLamb, ZeroOneAdam)
    params = [torch.nn.Parameter(torch.zeros(2))]
    for cls, name in ((FusedLamb, "deepspeed.ops.lamb.FusedLamb"),
                      (OnebitAdam, "deepspeed.runtime.fp16.onebit.OnebitAdam"),
                      (OnebitLamb, "deepspeed.runtime.fp16.onebit.OnebitLamb"),
                      (ZeroOneAdam, "deepspeed.runtime.fp16.onebit.ZeroOneAdam")):
        # mmengine registers only torch optimizer classes
        assert isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer), name
        try:
            cls(params, lr=1e-3)
        except NotImplementedError as e:
            assert str(e).startswith(f"deepcompile does not implement {name}") and "torch.optim.AdamW" in str(e), e
        else:
            raise AssertionError(f"{name} was constructed")


def _probe_engine_module_and_compression_helper():
    import torch

    import deepspeed
    from deepspeed.compression.helper import recursive_getattr, recursive_setattr
    from deepspeed.runtime.engine import DeepSpeedEngine

    assert DeepSpeedEngine is deepspeed.DeepSpeedEngine is deepspeed.runtime.engine.DeepSpeedEngine

    # DeepSpeed-Chat's convert_linear_layer_to_lora: a submodule by dotted name, replaced.
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
    assert recursive_getattr(model, "0.0") is model[0][0]
    replacement = torch.nn.Linear(2, 2, bias=False)
    recursive_setattr(model, "0.0", replacement)
    assert model[0][0] is replacement
    recursive_setattr(model, "0", torch.nn.Identity())
    assert isinstance(model[0], torch.nn.Identity)


def _probe_safe_accessors_need_an_engine():
    import torch

    import deepspeed
    from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,
                                 safe_get_local_fp32_param, safe_get_local_grad, safe_get_local_optimizer_state,
                                 safe_set_full_fp32_param, safe_set_full_optimizer_state, safe_set_local_fp32_param,
                                 safe_set_local_optimizer_state)

    # Implemented (tests/integrations/test_served_safe_get.py); a parameter of no engine is an error.
    p = torch.nn.Parameter(torch.zeros(2))
    one = torch.ones(1)
    calls = ((safe_get_full_grad, (p,)), (safe_get_full_fp32_param, (p,)), (safe_set_full_fp32_param, (p, p)),
             (safe_get_full_optimizer_state, (p, "exp_avg")), (safe_set_full_optimizer_state, (p, p, "exp_avg")),
             (safe_get_local_fp32_param, (p,)), (safe_get_local_grad, (p,)), (safe_set_local_fp32_param, (p, one)),
             (safe_get_local_optimizer_state, (p, "exp_avg")), (safe_set_local_optimizer_state, (p, one, "exp_avg")))
    for fn, args in calls:
        assert getattr(deepspeed.utils, fn.__name__) is fn
        try:
            fn(*args)
        except RuntimeError as e:
            assert str(e).startswith(f"deepspeed.utils.{fn.__name__}: this parameter belongs to no live deepcompile "
                                     "engine"), e
        else:
            raise AssertionError(f"{fn.__name__} returned")


def _probe_comm_extras():
    import torch
    import torch.distributed as dist

    import deepspeed
    import deepspeed.comm as comm

    # One gloo rank: the calls go through to torch.distributed and complete.
    deepspeed.init_distributed(dist_backend="gloo")
    assert comm.ReduceOp is dist.ReduceOp
    for name in ("send", "recv", "isend", "irecv"):  # point-to-point needs a peer: torch's own functions
        assert getattr(comm, name) is getattr(dist, name), name
    objects = [{"step": 3}, "tag"] if comm.get_rank() == 0 else [None, None]
    comm.broadcast_object_list(objects, src=0)
    assert objects == [{"step": 3}, "tag"]
    out = torch.empty(4)
    comm.all_to_all_single(out, torch.arange(4.0))
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0]
    gathered = torch.empty(3)
    comm.all_gather_into_tensor(gathered, torch.tensor([1.0, 2.0, 3.0]))
    assert gathered.tolist() == [1.0, 2.0, 3.0]
    scattered = torch.empty(2)
    comm.reduce_scatter_tensor(scattered, torch.tensor([4.0, 5.0]), op=comm.ReduceOp.SUM)
    assert scattered.tolist() == [4.0, 5.0]
    group = comm.new_group([0])
    assert comm.get_global_rank(group, 0) == 0
    comm.destroy_process_group()
    assert not comm.is_initialized()


# In this order: the comm probe, last, is the only one to start (and end) a process group.
_PROBES = ["_probe_deepspeed_chat_arguments_and_accelerator", "_probe_lightning_logging_and_optimizer_base",
           "_probe_checkpointing", "_probe_refused_optimizers", "_probe_engine_module_and_compression_helper",
           "_probe_safe_accessors_need_an_engine", "_probe_comm_extras"]


# ---- tests: in pytest's process ----------------------------------------------------------------

@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("served_names") / "outcomes.json")
    env = {"CUDA_VISIBLE_DEVICES": "", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(hf_launch._free_port())}
    return served_probes.run_in_served_child(__file__, "served_names_probes", out, env, timeout=300)


def _check(outcomes, probe):
    served_probes.check(outcomes, probe)


def test_deepspeed_chat_arguments_and_accelerator(outcomes):
    _check(outcomes, "_probe_deepspeed_chat_arguments_and_accelerator")


def test_lightning_logging_and_optimizer_base(outcomes):
    _check(outcomes, "_probe_lightning_logging_and_optimizer_base")


def test_checkpointing_configure_and_checkpoint(outcomes):
    _check(outcomes, "_probe_checkpointing")


def test_lamb_and_onebit_import_and_refuse_construction(outcomes):
    _check(outcomes, "_probe_refused_optimizers")


def test_runtime_engine_module_and_compression_helper(outcomes):
    _check(outcomes, "_probe_engine_module_and_compression_helper")


def test_safe_accessors_import_and_need_an_engine(outcomes):
    _check(outcomes, "_probe_safe_accessors_need_an_engine")


@pytest.mark.world_size(1)  # the served child is one gloo rank
def test_comm_extras_on_one_gloo_rank(outcomes):
    _check(outcomes, "_probe_comm_extras")
