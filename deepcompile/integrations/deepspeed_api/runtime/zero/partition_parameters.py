"""``deepspeed.runtime.zero.partition_parameters``: the two names transformers'
``prevent_arange_dtype_change`` reads and swaps around ``zero.Init``, and ``ZeroParamStatus``,
which TRL compares ``param.ds_status`` with.

``zero_wrapper_for_fp_tensor_constructor`` is what the served ``Init`` wraps torch's tensor
constructors with while a model is built (zero_init.CastOnCreation looks it up here on entry), so
the version transformers swaps in, which leaves ``_orig_torch_arange`` unconverted, is the one used.
"""

import torch

from deepcompile.integrations.deepspeed_api._missing import module_getattr
from deepcompile.integrations.deepspeed_api.zero import GatheredParameters, Init  # noqa: F401
from deepcompile.integrations.deepspeed_api.zero_init import cast_on_creation
from deepcompile.zero.gathered_params import ZeroParamStatus  # noqa: F401

_orig_torch_arange = torch.arange

zero_wrapper_for_fp_tensor_constructor = cast_on_creation


__getattr__ = module_getattr("deepspeed.runtime.zero.partition_parameters")
