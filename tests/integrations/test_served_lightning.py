"""Lightning's DeepSpeedStrategy fits on deepcompile (issue 41): ZeRO-2 and ZeRO-3 on two gloo
ranks, the parameters after three steps equal to one process training the same global batches
with torch's AdamW. Before, the fit failed at the strategy's config (its NVMe ``aio`` section),
then at torch.compile (Lightning deep-copies compile arguments: the backend holds a process
group), then at teardown (``optimizer.state``)."""

import os

import pytest
import torch

from _harness import hf_launch, paths

WORLD = 2
pytestmark = pytest.mark.world_size(WORLD)  # launched at WORLD ranks: ws2 in every test id (conftest.py)


@pytest.mark.parametrize("stage", [2, 3])
def test_lightning_deepspeed_strategy_fit(tmp_path, stage):
    pytest.importorskip("lightning")
    from _harness import lightning_case as w  # not the worker: it serves deepspeed at import

    # On the GPU machine (DC_TEST_DEVICE=cuda, two GPUs) the worker runs Lightning's own strategy
    # with its CUDA check, on NCCL.
    on_gpu = os.environ.get("DC_TEST_DEVICE") == "cuda" and torch.cuda.device_count() >= WORLD
    out = tmp_path / "state.pt"
    hf_launch.torchrun(str(paths.TESTS / "_harness" / "lightning_worker.py"),
                       ["--stage", str(stage), "--out", str(out), "--accelerator", "cuda" if on_gpu else "cpu"],
                       nproc=WORLD)
    got = torch.load(out)
    assert got["engine"].startswith("deepcompile."), got["engine"]

    # The reference: one process, the same model, each step on the two ranks' batches together
    # (Lightning's distributed sampler deals rows round robin; the ranks' mean losses are averaged).
    x, y = w.data()
    reference = w.build_net()
    opt = torch.optim.AdamW(reference.parameters(), lr=w.LR)
    step_rows = WORLD * w.PER_RANK_BATCH
    for step in range(w.STEPS):
        rows = slice(step * step_rows, (step + 1) * step_rows)
        loss = torch.nn.functional.mse_loss(reference(x[rows]), y[rows])
        opt.zero_grad()
        loss.backward()
        opt.step()
    # fp32 throughout (on GPUs too: torch's matmuls do not use TF32 unless asked); the only difference is the order of the gradient sums (two per-rank means
    # averaged against one mean over eight rows): a few ulps per step, far below one step's update
    # (lr 1e-2, AdamW moves every weight by about 1e-2 per step).
    for name, value in reference.named_parameters():
        torch.testing.assert_close(got["state"]["net." + name], value.detach(), rtol=0, atol=1e-5, msg=name)
