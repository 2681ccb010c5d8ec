"""``deepspeed.checkpoint.utils.clone_tensors_for_torch_save`` (accelerate's ZeRO-1/2 save path)."""

from typing import Any

import torch

from deepcompile.integrations.deepspeed_api._missing import module_getattr


def clone_tensors_for_torch_save(item: Any, device: torch.device = torch.device("cpu")) -> Any:
    """Copies of every tensor in a nested structure on ``device``, so a saved file holds only
    each tensor's own elements (not the storage it views)."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    return item


__getattr__ = module_getattr("deepspeed.checkpoint.utils")
