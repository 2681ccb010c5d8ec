"""``deepspeed.runtime.base_optimizer``: the base classes clients test optimizers against.

Lightning's DeepSpeed strategy asks ``isinstance(x, (Optimizer, DeepSpeedOptimizer))`` of the
items of a state it restores to decide whether to load optimizer state; the optimizer the served
``deepspeed.initialize`` returns (engine.py's ``OptimizerView``, not a torch Optimizer) is made
an instance of both, deepcompile's engines being ZeRO engines.
"""

import abc

from deepcompile.integrations.deepspeed_api._missing import module_getattr
from deepcompile.integrations.deepspeed_api.engine import OptimizerView


class DeepSpeedOptimizer(abc.ABC):
    pass


class ZeROOptimizer(DeepSpeedOptimizer):
    pass


ZeROOptimizer.register(OptimizerView)

__getattr__ = module_getattr("deepspeed.runtime.base_optimizer")
