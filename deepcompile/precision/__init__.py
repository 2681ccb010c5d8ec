"""Precision: the dtypes of the training state (policy.py) and fp16 loss scaling (loss_scaler.py)."""
