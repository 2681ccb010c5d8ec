"""``deepspeed.runtime.zero.offload_config``: the enums ``offload_states`` takes (OpenRLHF,
open-instruct and ms-swift import them for colocated RL)."""

from enum import Enum

from deepcompile.integrations.deepspeed_api._missing import module_getattr


class OffloadDeviceEnum(str, Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    optim_states = "optim_states"
    contiguous_grad_buffer = "contiguous_grad_buffer"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"


__getattr__ = module_getattr("deepspeed.runtime.zero.offload_config")
