"""Reading and writing model state on disk: Hugging Face safetensors weights and checkpoints."""
