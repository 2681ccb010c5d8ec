"""The model zoo: transformers' Trainer at ZeRO-3 on deepcompile (served as ``deepspeed``) trains
a tiny configuration of each architecture transformers' DeepSpeed model-zoo test covers: GPT-2,
BERT, T5, BART, OPT, GPT-NeoX, Llama, Qwen2, Mistral, Gemma, Phi, Mixtral, ViT.

Each is built from its config class with tiny sizes (hidden 32, 2 layers, vocabulary 96) and
trained 3 optimizer steps on two gloo ranks (2 rows a rank a step), compiled as the served engine
compiles by default (Inductor), fp32; tests/_harness/zoo_worker.py holds the cases and the worker,
which trains the architectures of one launch one after the other in the same two processes (one
process start-up and Inductor warm-up for all of them).

* With the configuration's own dropout (GPT-2, BERT, T5, BART and OPT use some; a bug made every
  such model fail its first compile, aa7690d): the losses are finite and sane (near the loss of a
  uniform guess, close to the run without dropout yet not equal to it: the compiled forward did
  drop), and every parameter moved.
* With every dropout probability 0: the logged loss and grad norm of every step and the trained
  parameters match one process training the same global batches with the same Trainer arguments
  without DeepSpeed (``zoo_worker.py --reference``; both with ``average_tokens_across_devices=False``,
  zoo_worker.py says why).

Tolerances (fp32 on CPU). The two runs differ in summation order only (two half-batch gradients
averaged against one whole-batch gradient, the norm summed over shards) and in Inductor's fused
kernels against eager ops: measured up to 2e-7 relative on losses and 7e-7 on grad norms, so
rtol 1e-5 / atol 1e-6 (as tests/integrations/test_hf_trainer.py); a wrong loss scaling, averaging
or a missed gradient is off by > 1e-3. Parameters, elementwise within LR / 10 (a tenth of one
AdamW step; measured up to 5e-5, T5 and ViT): AdamW divides each gradient by its own running
magnitude (plus eps 1e-8), so an element whose exact gradient is 0 (a key projection's bias, to
which softmax is blind) moves by lr * noise / (|noise| + eps), noise being the runs' ~1e-10
rounding differences: here up to about LR / 100, different in each run (such a tensor's update
agrees in nothing but size, so no per-tensor relative check applies). An optimizer step missed or
taken twice, or an element a shard boundary left out, is off by about LR. A gradient scaled
wrongly leaves AdamW's clipped steps nearly unchanged; the grad norms catch it.

Launches: GPT-2 (dropout at its defaults, which the fixed bug broke) runs in one launch and is not
marked; the rest of the zoo, BERT and T5 included, is marked ``slow`` (two more launches:
``DC_TEST_SLOW=1 bash scripts/run_tests.sh tests/clients/test_model_zoo.py``). An
architecture that fails on deepcompile stays here, marked ``xfail(strict=True)`` with the error.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from typing import Any, Dict, Tuple

import pytest
import torch

from _harness import hf_launch, zoo_worker as zoo

WORKER = os.path.join(os.path.dirname(hf_launch.TRAINER_PROBE), "zoo_worker.py")
pytestmark = pytest.mark.world_size(zoo.WORLD)  # launched at WORLD ranks: ws2 in every test id (conftest.py)

LAUNCHES: Tuple[Tuple[str, ...], ...] = (
    ("gpt2",),  # CI: the dropout architecture every client tests first (one launch, for the suite's time)
    ("bert", "t5", "bart", "opt", "gpt_neox"),
    ("phi", "vit", "llama", "qwen2", "mistral", "gemma", "mixtral"),
)
CI_ARCHS = LAUNCHES[0]
# Architectures that fail on deepcompile: arch -> the error (kept in the slow suite, strict xfail).
XFAIL: Dict[str, str] = {}
# One launch trains up to 7 runs with Inductor on two ranks: ~6-10 min on 2 busy CPU cores.
LAUNCH_TIMEOUT_S = 1500

TOL = dict(rtol=1e-5, atol=1e-6)
PARAM_ATOL = zoo.LR / 10


def _params():
    out = []
    for arch in zoo.ARCHS:
        marks = [] if arch in CI_ARCHS else [pytest.mark.slow]
        if arch in XFAIL:
            marks.append(pytest.mark.xfail(strict=True, reason=XFAIL[arch]))
        out.append(pytest.param(arch, marks=marks, id=arch))
    return out


def _run(cmd, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=hf_launch.launch_env(), cwd=hf_launch.ROOT, capture_output=True, text=True,
                          timeout=timeout)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launch:
    """The runs of one launch's architectures (the reference in one process, then torchrun)."""

    def __init__(self, archs: Tuple[str, ...], out: str):
        self.out = out
        ref = _run([sys.executable, WORKER, "--reference", "--archs", ",".join(archs), "--out-dir", out], 600)
        assert ref.returncode == 0, f"reference run failed:\n{ref.stdout[-3000:]}\n{ref.stderr[-6000:]}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(zoo.WORLD), "--master-addr",
               "127.0.0.1", "--master-port", str(_free_port()), WORKER, "--archs", ",".join(archs), "--out-dir", out]
        try:
            proc = _run(cmd, LAUNCH_TIMEOUT_S)
            self.failure = None if proc.returncode == 0 else (
                f"torchrun exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
        except subprocess.TimeoutExpired as e:
            self.failure = f"torchrun ran past {LAUNCH_TIMEOUT_S} s:\n{(e.stdout or b'')[-4000:]!r}"

    def result(self, arch: str, run: str) -> Dict[str, Any]:
        """What rank 0 wrote for ``arch``'s ``run``; the error a rank recorded is raised as such."""
        errors = sorted(f for f in os.listdir(self.out) if f.startswith(f"{arch}.{run}.rank") and f.endswith(".json"))
        if errors:
            with open(os.path.join(self.out, errors[0])) as f:
                error = json.load(f)
            raise AssertionError(f"{arch} ({run}) failed on {errors[0].split('.')[2]}: {error['type']}: "
                                 f"{error['message']}\n{error['traceback']}")
        path = os.path.join(self.out, f"{arch}.{run}.pt")
        assert os.path.exists(path), self.failure or f"no result for {arch} ({run})"
        return torch.load(path)


@pytest.fixture(scope="module")
def zoo_runs(tmp_path_factory):
    """arch -> its launch's runs; each launch runs once, when a test first asks for one of its
    architectures (deselecting the slow tests leaves one launch)."""
    launches: Dict[Tuple[str, ...], Launch] = {}

    def runs(arch: str) -> Launch:
        archs = next(group for group in LAUNCHES if arch in group)
        if archs not in launches:
            launches[archs] = Launch(archs, str(tmp_path_factory.mktemp("zoo")))
        return launches[archs]

    return runs


def _moved(result) -> list:
    """The parameters whose trained value differs from the initial one."""
    return [n for n in result["parameters"] if not torch.equal(result["final"][n], result["initial"][n])]


def _check_ran_on_deepcompile(result) -> None:
    assert result["engine"] == "deepcompile.integrations.deepspeed_api.engine" and result["world_size"] == zoo.WORLD
    assert result["stage"] == 3
    assert result["compiled"] and result["compiled"].startswith("compiled (inductor"), result["compiled"]
    assert result["global_step"] == zoo.STEPS and len(result["losses"]) == zoo.STEPS


@pytest.mark.parametrize("arch", _params())
def test_zoo_trains_with_default_dropout(zoo_runs, arch):
    """The configuration's own dropout (where its model uses none, the run without dropout is
    this run): finite losses near a uniform guess's, every parameter trained; with dropout,
    within 10% of the run without it yet different (masks were drawn in the compiled forward)."""
    launch = zoo_runs(arch)
    active = zoo.active_dropout(arch)
    result = launch.result(arch, "dropout" if active else "no_dropout")
    _check_ran_on_deepcompile(result)
    losses, chance = torch.tensor(result["losses"]), zoo.chance_loss(arch)
    assert torch.isfinite(losses).all() and torch.isfinite(torch.tensor(result["grad_norms"])).all(), result
    assert ((losses > 0.5 * chance) & (losses < 1.5 * chance)).all(), (losses, chance)
    assert _moved(result) == result["parameters"]
    if active:
        without = torch.tensor(launch.result(arch, "no_dropout")["losses"])
        assert (losses - without).abs().max() < 0.1 * chance, (losses, without)
        assert (losses[0] - without[0]).abs() > 1e-5 * chance, (losses, without)  # not the run without dropout
    else:
        assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("arch", _params())
def test_zoo_without_dropout_matches_one_process(zoo_runs, arch):
    """Every dropout 0: losses, grad norms and trained parameters as one process without
    DeepSpeed training the same global batches (the module docstring justifies the tolerances)."""
    launch = zoo_runs(arch)
    got, want = launch.result(arch, "no_dropout"), launch.result(arch, "reference")
    _check_ran_on_deepcompile(got)
    assert want["world_size"] == 1 and len(want["losses"]) == zoo.STEPS
    for name in want["initial"]:  # the same model to start from (same seed, built whole before Trainer)
        assert torch.equal(got["initial"][name], want["initial"][name]), name
    for key in ("losses", "grad_norms"):
        torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(want[key]), **TOL,
                                   msg=lambda m: f"{key}: {m}")
    assert want["losses"][-1] < want["losses"][0], want["losses"]  # it learned
    assert set(want["parameters"]) <= set(got["final"]), set(want["parameters"]) - set(got["final"])
    assert _moved(got) == got["parameters"]
    for name in want["parameters"]:
        torch.testing.assert_close(got["final"][name], want["final"][name], rtol=0, atol=PARAM_ATOL,
                                   msg=lambda m: f"{name}: {m}")
