"""deepcompile: ZeRO-1/2/3 sharded data parallelism through torch.compile graph rewriting.

    engine = deepcompile.initialize(model, optimizer, config)
    engine.compile()                      # optional; without it the engine trains eagerly
    loss = engine(batch); engine.backward(loss); engine.step()
"""

from deepcompile import runtime  # noqa: F401  (loads the op library: torch.ops.dc.*)
from deepcompile import compat
from deepcompile.checkpoint.hf_weights import load_hf_weights
from deepcompile.compiler.compiled_module import deepcompile_backend
from deepcompile.config import Config
from deepcompile.engine import Engine, initialize
from deepcompile.scheduling.report import format_schedule_report
from deepcompile.integrations import serve_as_deepspeed
from deepcompile.zero.leaf_modules import set_leaf_modules

__all__ = ["Config", "Engine", "format_schedule_report", "initialize", "load_hf_weights", "runtime",
           "serve_as_deepspeed", "set_leaf_modules"]

compat.register_backend("deepcompile", deepcompile_backend)
