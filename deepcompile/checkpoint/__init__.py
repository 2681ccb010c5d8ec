"""Model state on disk: Hugging Face safetensors weights and distributed checkpoints. Each module
reads or writes one format through the stage-agnostic ``zero.sharding.Sharding`` accessors (never
a stage's internals)."""
