"""Partitioning of parameters, gradients and optimizer state (ZeRO stages)."""
