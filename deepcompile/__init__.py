"""deepcompile: ZeRO-1/2/3 sharded data parallelism through torch.compile graph rewriting."""

from deepcompile import runtime  # noqa: F401  (loads the op library: torch.ops.dc.*)

__all__ = ["runtime"]
