"""The model, data and settings of the Lightning run (tests/_harness/lightning_worker.py) that the
test's single-process reference shares. Imports neither Lightning nor deepcompile's served
package: the test process may have imported transformers already, after which nothing may be
served as ``deepspeed`` there."""

import torch

STEPS, PER_RANK_BATCH, LR = 3, 4, 1e-2


def build_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)
