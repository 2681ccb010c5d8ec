"""The one refusal of the 1-bit optimizers (onebit/__init__.py says why they must import).

They subclass torch's Optimizer so that registries taking only optimizer classes (mmengine's)
list them, and a config naming one gets this message rather than an unknown name.
"""

from typing import Any

import torch

from deepcompile.integrations.deepspeed_api._missing import refused


class RefusedOptimizer(torch.optim.Optimizer):
    served_as = ""  # the DeepSpeed name
    instead = "torch.optim.AdamW"

    def __init__(self, *args: Any, **kwargs: Any):
        # Their point is compressing the data-parallel gradient all-reduce; deepcompile's ZeRO
        # reduces gradients in its own runtime, which has no compressed collective.
        raise refused(self.served_as, f"use {self.instead} (deepcompile's ZeRO reduces the gradients itself; "
                                      "compressed gradient communication is not implemented)")
