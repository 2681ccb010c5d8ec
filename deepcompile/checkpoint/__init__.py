"""Checkpoints and weights on disk: each module here reads or writes one format, through the
stage-agnostic ``zero.sharding.Sharding`` accessors (never a stage's internals)."""
