"""``deepspeed.runtime.sequence_parallel``: DeepSpeed's ALST / Ulysses entry points
(``ulysses_sp``: ``UlyssesSPAttentionHF.register_with_transformers`` and
``UlyssesSPDataLoaderAdapter``), served over deepcompile's sequence parallelism
(deepcompile/sequence_parallel/, config key ``sequence_parallel_size``)."""

from deepcompile.integrations.deepspeed_api._missing import module_getattr
from deepcompile.integrations.deepspeed_api.runtime.sequence_parallel import ulysses_sp  # noqa: F401

__getattr__ = module_getattr("deepspeed.runtime.sequence_parallel")
