"""Running programs written for DeepSpeed (Hugging Face Trainer, accelerate) on deepcompile.

``deepcompile.serve_as_deepspeed()`` (``serve.py``) makes ``import deepspeed`` return
``deepspeed_api``, deepcompile's implementation of the part of DeepSpeed's public surface those
programs use, so they take their DeepSpeed code path unchanged and land on
:class:`deepcompile.Engine`. Why this route and what it covers: docs/huggingface.md.
"""

from deepcompile.integrations.serve import serve_as_deepspeed

__all__ = ["serve_as_deepspeed"]
