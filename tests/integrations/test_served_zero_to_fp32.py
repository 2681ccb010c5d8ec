"""The served ``deepspeed.utils.zero_to_fp32`` over checkpoints of ``engine.save_checkpoint``.

Checkpoints of ZeRO-2 and ZeRO-3 are written by two gloo ranks (a model with a tied parameter and
a persistent buffer, trained a step, saved as ``first`` and named by ``latest``; trained another
step, saved as ``second`` without touching ``latest``), with the engine's
``full_state_dict()`` at each save beside them. Then, in this process, without a process group:

* ``get_fp32_state_dict_from_zero_checkpoint`` equals, bitwise and in fp32, the engine's full
  state at the save, and what the offline reader and ``deepcompile export --dtype fp32`` give
  for the same checkpoint; the only name left out is the tied alias; ``tag=None`` reads the
  checkpoint ``latest`` names (not the newer one), an explicit tag the one named;
* ``convert_zero_checkpoint_to_fp32_state_dict`` writes ``pytorch_model.bin`` / ``model.safetensors``
  that read back to the same tensors, and with a tiny ``max_shard_size`` numbered files and an
  index json whose weight map covers every tensor; a later unsharded conversion into the same
  folder leaves no stale shard or index behind;
* ``load_state_dict_from_zero_checkpoint`` fills a fresh model (tied names included) and returns
  it; a model the checkpoint does not match is refused, unchanged;
* ``lazy_mode=True`` and ``exclude_frozen_parameters=True`` are refused with a message;
* a bf16 ZeRO-3 checkpoint gives the fp32 masters (not the bf16 parameters upcast), as DeepSpeed's does;
* after ``serve_as_deepspeed()`` (in a child process: it rewrites ``sys.modules``) both
  ``from deepspeed.utils.zero_to_fp32 import ...`` and ``deepspeed.utils.zero_to_fp32.<fn>`` work.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from _harness.multiproc import run_distributed
from _harness.parity_cases import GLOBAL_BATCH, batch, make_optimizer
from _harness.paths import ROOT
from _harness.tied_lm import TiedBufferedLM

from deepcompile.integrations.deepspeed_api.utils import zero_to_fp32

pytestmark = pytest.mark.world_size(2)
STAGES = (2, 3)


def _save_body(ctx, root, stages):
    import deepcompile

    n = GLOBAL_BATCH // ctx.world_size
    for stage in stages:
        torch.manual_seed(7)
        model = TiedBufferedLM()
        cfg = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
        engine = deepcompile.initialize(model, make_optimizer(model.parameters()), cfg)
        where = os.path.join(root, f"stage{stage}")
        for step, tag, latest in ((0, "first", True), (1, "second", False)):
            tokens, _ = batch("tied", step)
            part = tokens[ctx.rank * n:(ctx.rank + 1) * n]
            engine.backward(engine(part, part))
            engine.step()
            engine.save_checkpoint(where, tag=tag, save_latest=latest)
            state = engine.full_state_dict(all_ranks=True)
            if ctx.rank == 0:
                torch.save(state, os.path.join(root, f"expected_stage{stage}_{tag}.pt"))
        engine.destroy()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("zero_to_fp32"))
    run_distributed(_save_body, 2, args=(root, STAGES), timeout=300)
    return root


def _expected(root, stage, tag):
    return torch.load(os.path.join(root, f"expected_stage{stage}_{tag}.pt"))


def _assert_same(got, want, what):
    assert list(got) == list(want), f"{what}: names {list(got)} != {list(want)}"
    for name in want:
        assert got[name].dtype == want[name].dtype, f"{what}: {name} {got[name].dtype} != {want[name].dtype}"
        assert torch.equal(got[name], want[name]), f"{what}: {name} differs"


def _matches_engine(got, expected, what):
    """``got`` is the engine's full state, fp32, less the tied alias stored under the other name."""
    assert set(expected) - set(got) == {"head.weight"}, f"{what}: left out {sorted(set(expected) - set(got))}"
    assert set(got) <= set(expected), f"{what}: extra {sorted(set(got) - set(expected))}"
    for name, value in got.items():
        assert value.device.type == "cpu" and value.dtype == torch.float32, \
            f"{what}: {name} {value.device} {value.dtype}"
        assert torch.equal(value, expected[name]), f"{what}: {name} differs from the engine's full_state_dict"


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: f"zero{s}")
def test_state_dict_equals_engine_offline_reader_and_export(saved, stage, tmp_path):
    from safetensors.torch import load_file

    from deepcompile.checkpoint.offline import OfflineCheckpoint
    from deepcompile.cli import export

    ckpt = os.path.join(saved, f"stage{stage}")
    first, second = _expected(saved, stage, "first"), _expected(saved, stage, "second")
    assert not torch.equal(first["mix.weight"], second["mix.weight"])  # the two tags tell apart

    latest = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(ckpt)
    _matches_engine(latest, first, "tag=None (latest names 'first')")
    assert "scale" in latest  # the persistent buffer
    named = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="second")
    _matches_engine(named, second, "tag='second'")

    offline = {stored.name: value for stored, value in OfflineCheckpoint(ckpt, "second").read()}
    _assert_same(named, offline, "against the offline reader")

    out = str(tmp_path / "export")
    args = argparse.Namespace(checkpoint=ckpt, out=out, tag="second", dtype="fp32", max_shard_size="5GB",
                              config=None, overwrite=False)
    assert export.run(args) == 0
    exported = load_file(os.path.join(out, "model.safetensors"))
    assert set(exported) == set(named)
    _assert_same(named, {name: exported[name] for name in named}, "against deepcompile export")


def _read_back(folder, safe):
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors" if safe else ".bin"))
    out = {}
    for f in files:
        part = load_file(os.path.join(folder, f)) if safe else torch.load(os.path.join(folder, f), weights_only=True)
        assert not set(part) & set(out), f"{f} repeats {sorted(set(part) & set(out))}"
        out.update(part)
    return files, out


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: f"zero{s}")
@pytest.mark.parametrize("safe", [False, True], ids=["bin", "safetensors"])
def test_convert_writes_files_that_read_back(saved, stage, safe, tmp_path):
    ckpt = os.path.join(saved, f"stage{stage}")
    want = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(ckpt)
    single, index = ("model.safetensors", "model.safetensors.index.json") if safe else \
        ("pytorch_model.bin", "pytorch_model.bin.index.json")

    out = str(tmp_path / "sharded")
    zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(ckpt, out, max_shard_size=200, safe_serialization=safe)
    files, got = _read_back(out, safe)
    assert len(files) > 1 and single not in files, files
    _matches_engine(got, _expected(saved, stage, "first"), "sharded files")
    with open(os.path.join(out, index)) as f:
        weight_map = json.load(f)["weight_map"]
    assert set(weight_map) == set(want) and set(weight_map.values()) == set(files)
    for name, file in weight_map.items():
        assert name in _read_back_one(os.path.join(out, file), safe), f"the index places {name} in {file}"

    # Unsharded into the same folder: one file, and no shard or index of the earlier run left.
    zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(ckpt, out, safe_serialization=safe)
    assert sorted(os.listdir(out)) == [single]
    files, got = _read_back(out, safe)
    _assert_same(got, want, "single file")


def _read_back_one(path, safe):
    from safetensors.torch import load_file

    return load_file(path) if safe else torch.load(path, weights_only=True)


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: f"zero{s}")
def test_load_state_dict_into_a_fresh_model(saved, stage):
    ckpt = os.path.join(saved, f"stage{stage}")
    expected = _expected(saved, stage, "second")
    torch.manual_seed(99)
    model = TiedBufferedLM()
    model.scale.zero_()
    assert not torch.equal(model.mix.weight, expected["mix.weight"])
    loaded = zero_to_fp32.load_state_dict_from_zero_checkpoint(model, ckpt, tag="second")
    assert loaded is model and model.head.weight is model.embed.weight
    state = model.state_dict()
    assert set(state) == set(expected)
    for name, value in expected.items():
        assert torch.equal(state[name], value), f"{name} was not loaded"

    class Other(TiedBufferedLM):
        def __init__(self):
            super().__init__()
            self.extra = nn.Linear(2, 2)

    other = Other()
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"does not match the model .*extra\.weight.*the model was not changed"):
        zero_to_fp32.load_state_dict_from_zero_checkpoint(other, ckpt)
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())


def test_unsupported_arguments_are_refused(saved, tmp_path):
    ckpt = os.path.join(saved, "stage3")
    with pytest.raises(NotImplementedError, match=r"lazy_mode=True.*convert_zero_checkpoint_to_fp32_state_dict"):
        zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(ckpt, lazy_mode=True)
    with pytest.raises(NotImplementedError, match=r"exclude_frozen_parameters=True.*does not record which parameters"):
        zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(ckpt, exclude_frozen_parameters=True)
    out = str(tmp_path / "refused")
    with pytest.raises(NotImplementedError, match=r"convert_zero_checkpoint_to_fp32_state_dict\(exclude_frozen"):
        zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(ckpt, out, exclude_frozen_parameters=True)
    with pytest.raises(ValueError, match="max_shard_size"):
        zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(ckpt, out, max_shard_size="lots")
    with pytest.raises(RuntimeError, match="no checkpoint 'nope'"):
        zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(ckpt, out, tag="nope")
    assert not os.path.exists(out)  # every refusal came before anything was written


_SERVED_CHILD = """
import sys, torch
import deepcompile
deepcompile.serve_as_deepspeed()
from deepspeed.utils.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,
                                          get_fp32_state_dict_from_zero_checkpoint,
                                          load_state_dict_from_zero_checkpoint)
import deepspeed
assert deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint is get_fp32_state_dict_from_zero_checkpoint
got = deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(sys.argv[1])
want = torch.load(sys.argv[2])
assert got and all(torch.equal(v, want[k]) for k, v in got.items()), "served call differs"
print("served ok", len(got))
"""


def test_served_import_paths(saved):
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, "-c", _SERVED_CHILD, os.path.join(saved, "stage3"),
                           os.path.join(saved, "expected_stage3_first.pt")],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0 and "served ok 6" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]


def _save_bf16_body(ctx, root):
    import deepcompile
    from deepcompile.integrations.deepspeed_api.utils import safe_get_full_fp32_param

    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()),
                                    {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}})
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(ctx.rank)).to(torch.bfloat16)
    engine.backward(engine(x).float().square().mean())
    engine.step()
    engine.save_checkpoint(root, tag="bf16")
    masters = {name: safe_get_full_fp32_param(p).cpu() for name, p in model.named_parameters()}
    if ctx.rank == 0:
        torch.save(masters, os.path.join(root, "masters.pt"))
    engine.destroy()


def test_a_bf16_checkpoint_gives_the_fp32_masters(tmp_path):
    """As DeepSpeed's: the fp32 master weights, not the bf16 parameters upcast (at least one
    master differs from its bf16 rounding, so an upcast copy would not pass)."""
    root = str(tmp_path / "bf16")
    run_distributed(_save_bf16_body, 2, args=(root,), timeout=300)
    masters = torch.load(os.path.join(root, "masters.pt"))
    got = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(root, tag="bf16")
    assert set(masters) == set(got)
    rounded_away = 0
    for name, master in masters.items():
        assert got[name].dtype == torch.float32, f"{name}: {got[name].dtype}"
        assert torch.equal(got[name], master), f"{name} is not the fp32 master"
        rounded_away += int(not torch.equal(master.to(torch.bfloat16).float(), master))
    assert rounded_away > 0
