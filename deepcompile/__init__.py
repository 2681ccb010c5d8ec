"""deepcompile: ZeRO-1/2/3 sharded data parallelism through torch.compile graph rewriting.

    engine = deepcompile.initialize(model, optimizer, config)
    engine.compile()                      # optional; without it the engine trains eagerly
    loss = engine(batch); engine.backward(loss); engine.step()
"""

from deepcompile import runtime  # noqa: F401  (loads the op library: torch.ops.dc.*)
from deepcompile.config import Config
from deepcompile.engine import Engine, initialize
from deepcompile.leaf_modules import set_leaf_modules

__all__ = ["Config", "Engine", "initialize", "runtime", "set_leaf_modules"]


def _register_backend() -> None:
    import torch._dynamo
    from torch._dynamo.backends.registry import lookup_backend

    from deepcompile.compiler.backend import deepcompile_backend

    try:
        lookup_backend("deepcompile")
    except Exception:  # not registered yet (the entry point registers it lazily by name)
        torch._dynamo.register_backend(name="deepcompile")(deepcompile_backend)


_register_backend()
