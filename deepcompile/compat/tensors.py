"""Multi-tensor kernels: one launch over a list of tensors instead of one per tensor."""

from __future__ import annotations

from typing import List, Sequence

import torch


def foreach_norm(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """The L2 norm of each tensor (0-dim tensors). Relies on ``torch._foreach_norm``."""
    return list(torch._foreach_norm(list(tensors)))


def foreach_mul_(tensors: Sequence[torch.Tensor], scalar) -> None:
    """Multiply every tensor in place by ``scalar`` (a number or a 0-dim tensor).
    Relies on ``torch._foreach_mul_``."""
    torch._foreach_mul_(list(tensors), scalar)
