"""``deepspeed.runtime.zero.partition_parameters``: the two names transformers'
``prevent_arange_dtype_change`` reads and swaps around ``zero.Init``, and ``ZeroParamStatus``,
which TRL compares ``param.ds_status`` with.

deepcompile's ``Init`` does not redirect tensor constructors, so the wrapper transformers
installs here is never called; it only has to exist.
"""

import torch

from deepcompile.integrations.deepspeed_api._missing import module_getattr
from deepcompile.integrations.deepspeed_api.zero import GatheredParameters, Init  # noqa: F401
from deepcompile.zero.gathered_params import ZeroParamStatus  # noqa: F401

_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype=None, **kwargs):
    return fn


__getattr__ = module_getattr("deepspeed.runtime.zero.partition_parameters")
