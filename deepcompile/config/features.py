"""Switches for features whose config keys are parsed before the runtime behind them lands.

``FP16_LOSS_SCALING``: ``fp16.enabled: true`` is accepted (and the loss-scaling keys of the
``fp16`` section are read) once ``deepcompile/precision/loss_scaler.py`` trains fp16 with
DeepSpeed's dynamic loss scaling. Until then ``fp16.enabled: true`` is refused and the
loss-scaling keys are inert (``inert.INERT``). Flipping it is the one change the config needs.
"""

FP16_LOSS_SCALING = True
