"""accelerate's DeepSpeed ZeRO-3 path running on deepcompile (deepcompile.serve_as_deepspeed()).

The real accelerate loop (examples/hf_accelerate.py: ``Accelerator``, ``prepare``,
``accelerator.backward``, ``optimizer.step``, ``scheduler.step``, ``optimizer.zero_grad``) on two
gloo ranks, configured by a DeepSpeedPlugin and by ``accelerate launch --config_file``, against
the same training in one process with plain PyTorch on the same global batches.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch

from _harness import hf_launch

EXAMPLE = os.path.join(hf_launch.EXAMPLES, "hf_accelerate.py")
DS_CONFIG = os.path.join(hf_launch.EXAMPLES, "ds_config_zero3.json")
LAUNCH_CONFIG = os.path.join(hf_launch.EXAMPLES, "accelerate_deepspeed.yaml")
ROWS, MICRO, ACCUM, WORLD, LR = 48, 2, 2, 2, 1e-2

# fp32 on CPU: the runs differ only in summation order (each rank's half-batch gradient, averaged
# by the reduce-scatter, against one whole-batch gradient), ~1e-7 relative per step; AdamW at this
# LR over 6 steps keeps the losses within ~1e-7 relative (measured). A wrong averaging, window
# boundary, clipping or schedule step moves them by >1e-3.
TOL = dict(rtol=1e-5, atol=1e-6)


@functools.lru_cache(maxsize=None)
def _reference(rows=ROWS, epochs=1):
    return hf_launch.accelerate_reference(rows, MICRO, ACCUM, WORLD, LR, epochs=epochs)


def _args(out, rows=ROWS):
    return ["--rows", str(rows), "--micro-batch", str(MICRO), "--accumulation", str(ACCUM), "--lr", str(LR),
            "--out", str(out)]


def _check(result, rows=ROWS, epochs=1):
    ref = _reference(rows, epochs)
    assert result["world_size"] == WORLD
    assert result["engine"] == "deepcompile.integrations.deepspeed_api.engine"  # deepcompile trained it
    assert len(result["losses"]) == len(ref["losses"]) == epochs * -(-rows // (MICRO * WORLD * ACCUM))
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"]), **TOL)
    torch.testing.assert_close(torch.tensor(result["lrs"]), torch.tensor(ref["lrs"]), rtol=1e-6, atol=1e-9)
    assert result["losses"][-1] < result["losses"][0] - 0.3  # it learned


@pytest.fixture(scope="module")
def plugin_run(tmp_path_factory):
    """The loop with a DeepSpeedPlugin, saving its state (accelerator.save_state) after step 3."""
    base = tmp_path_factory.mktemp("hf_accelerate")
    hf_launch.torchrun(EXAMPLE, ["--ds-config", DS_CONFIG, "--state-dir", str(base / "state"), "--state-step", "3",
                                 *_args(base / "run.json")], nproc=WORLD)
    return base, hf_launch.read_json(base / "run.json")


@pytest.mark.world_size(WORLD)  # torchrun at WORLD ranks
def test_accelerate_deepspeed_plugin_matches_single_process(plugin_run):
    _check(plugin_run[1])


@pytest.mark.world_size(WORLD)  # torchrun at WORLD ranks
def test_accelerate_load_state_continues_exactly(plugin_run):
    """accelerator.load_state of the state saved after step 3, then skip_first_batches: steps
    4..6 are those of the uninterrupted run, bitwise (same ranks, same work)."""
    base, full = plugin_run
    hf_launch.torchrun(EXAMPLE, ["--ds-config", DS_CONFIG, "--state-dir", str(base / "state"), "--state-step", "3",
                                 "--resume", *_args(base / "resumed.json")], nproc=WORLD)
    resumed = hf_launch.read_json(base / "resumed.json")
    assert resumed["first_step"] == 4
    assert resumed["losses"] == full["losses"][3:]
    assert resumed["lrs"] == full["lrs"][3:]


@pytest.mark.world_size(WORLD)  # LAUNCH_CONFIG's num_processes
def test_accelerate_launch_config_file_matches_single_process(tmp_path):
    """``accelerate launch --config_file`` (distributed_type DEEPSPEED naming the DeepSpeed
    config): the launcher sets ACCELERATE_* variables and the script builds its plugin from them."""
    out = tmp_path / "run.json"
    cmd = [sys.executable, "-m", "deepcompile.integrations.accelerate_launch", "--config_file", LAUNCH_CONFIG,
           "--main_process_port", str(hf_launch._free_port()), EXAMPLE, *_args(out)]
    hf_launch.run_checked(cmd, env=hf_launch.launch_env())
    _check(hf_launch.read_json(out))


@pytest.mark.world_size(WORLD)  # LAUNCH_CONFIG's num_processes
def test_accelerate_regional_compilation_becomes_deepcompile_per_layer_graphs(tmp_path):
    """accelerate's regional compilation (``use_regional_compilation``): accelerate compiles each
    repeated block in place around the engine (plain torch.compile over the eager ZeRO hooks);
    the served engine takes that over before the first forward and compiles the blocks as its own
    per-layer graphs, and the run still trains as one process does."""
    import json

    with open(DS_CONFIG) as f:
        ds_config = json.load(f)
    ds_config["compile"] = {"backend": "eager"}  # fast on the CPU; the graphs are the same
    ds_path = tmp_path / "ds_config.json"
    ds_path.write_text(json.dumps(ds_config))
    with open(LAUNCH_CONFIG) as f:
        launch = f.read().replace("examples/ds_config_zero3.json", str(ds_path))
    launch_path = tmp_path / "accelerate.yaml"
    launch_path.write_text(launch)
    out = tmp_path / "run.json"
    cmd = [sys.executable, "-m", "deepcompile.integrations.accelerate_launch", "--config_file", str(launch_path),
           "--main_process_port", str(hf_launch._free_port()), EXAMPLE, *_args(out)]
    # accelerate 1.15's DeepSpeed launcher does not pass a config file's dynamo_config on to the
    # ranks (its other launchers do), with or without the real DeepSpeed: the settings reach
    # TorchDynamoPlugin through its environment variables.
    hf_launch.run_checked(cmd, env=hf_launch.launch_env({"ACCELERATE_DYNAMO_BACKEND": "EAGER",
                                                         "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "true"}))
    result = hf_launch.read_json(out)
    # The engine's own per-layer graphs of the blocks accelerate compiled (before the take-over:
    # "uncompiled (eager ZeRO hooks ...)" with accelerate's compiled blocks around them).
    assert "compiled (eager, per layer: " in (result["summary"] or ""), result["summary"]
    _check(result)


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=hf_launch.launch_env(), cwd=hf_launch.ROOT,
                          capture_output=True, text=True, timeout=300)


def test_served_deepspeed_names_what_it_does_not_implement():
    proc = _python(
        "import deepcompile; deepcompile.serve_as_deepspeed(); deepcompile.serve_as_deepspeed()\n"
        "import importlib.metadata as md, deepspeed\n"
        "print('version', md.version('deepspeed'))\n"
        "from accelerate.utils import is_deepspeed_available; print('accelerate sees', is_deepspeed_available())\n"
        "try:\n    deepspeed.init_inference\nexcept AttributeError as e:\n    print('attr:', e)\n"
        "try:\n    import deepspeed.moe.layer\nexcept ImportError as e:\n    print('module:', e)\n")
    assert proc.returncode == 0, proc.stderr
    assert "version 0.20.2+deepcompile" in proc.stdout
    assert "accelerate sees True" in proc.stdout
    assert "attr: deepcompile does not implement deepspeed.init_inference" in proc.stdout
    assert "module: deepcompile does not implement the module deepspeed.moe" in proc.stdout


def test_serve_refuses_when_real_deepspeed_is_imported():
    proc = _python("import sys, types; sys.modules['deepspeed'] = types.ModuleType('deepspeed')\n"
                   "import deepcompile; deepcompile.serve_as_deepspeed()")
    assert proc.returncode != 0
    assert "the real deepspeed package is already imported" in proc.stderr


def test_serve_refuses_after_accelerate_decided_deepspeed_is_absent():
    proc = _python("import accelerate.accelerator\nimport deepcompile; deepcompile.serve_as_deepspeed()")
    assert proc.returncode != 0
    assert "must run before accelerate is imported" in proc.stderr


@pytest.mark.world_size(WORLD)  # torchrun at WORLD ranks
def test_accelerate_optimizer_offload_config_matches_single_process(tmp_path):
    """offload_optimizer {device: cpu}: accelerate swaps the torch AdamW for
    deepspeed.ops.adam.DeepSpeedCPUAdam (served as torch's AdamW, deepcompile keeping its state on
    the host as the config says); training is unchanged."""
    out = tmp_path / "run.json"
    config = os.path.join(hf_launch.EXAMPLES, "ds_config_zero3_offload.json")
    hf_launch.torchrun(EXAMPLE, ["--ds-config", config, *_args(out)], nproc=WORLD)
    _check(hf_launch.read_json(out))


def test_served_cpu_adam_is_torch_adam_with_the_same_update():
    proc = _python(
        "import deepcompile; deepcompile.serve_as_deepspeed()\n"
        "import torch; from deepspeed.ops.adam import DeepSpeedCPUAdam\n"
        "p = [torch.nn.Parameter(torch.ones(2))]\n"
        "print(type(DeepSpeedCPUAdam(p, lr=0.1, adamw_mode=True)).__name__, "
        "type(DeepSpeedCPUAdam(p, lr=0.1, adamw_mode=False)).__name__)\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["AdamW", "Adam"]


@pytest.mark.world_size(WORLD)  # torchrun at WORLD ranks
def test_accelerate_short_last_window_matches_single_process(tmp_path):
    """11 micro-batches per rank with 2 per window, two epochs: accelerate ends each epoch's last
    window after one micro-batch (end of the loader) through set_gradient_accumulation_boundary;
    that step is taken, as in DeepSpeed, the next epoch starts a new window (save_state right
    after it is at a window boundary, and resuming from it continues exactly), and the run stays
    equal to the reference."""
    rows, state = 44, ["--state-dir", str(tmp_path / "state"), "--state-step", "6"]  # step 6 ends epoch 1
    out = tmp_path / "run.json"
    hf_launch.torchrun(EXAMPLE, ["--ds-config", DS_CONFIG, "--epochs", "2", *state, *_args(out, rows)], nproc=WORLD)
    full = hf_launch.read_json(out)
    _check(full, rows, epochs=2)
    resumed_out = tmp_path / "resumed.json"
    hf_launch.torchrun(EXAMPLE, ["--ds-config", DS_CONFIG, "--epochs", "2", *state, "--resume",
                                 *_args(resumed_out, rows)], nproc=WORLD)
    # Not bitwise: the uninterrupted run recompiled for the short window's batch (Dynamo then
    # marks the batch dimension dynamic and runs dynamic-shape kernels), the resumed run compiles
    # its first graphs for a static shape. Same math, other kernels: 3e-8 relative measured.
    torch.testing.assert_close(torch.tensor(hf_launch.read_json(resumed_out)["losses"]),
                               torch.tensor(full["losses"][6:]), rtol=1e-6, atol=0)
