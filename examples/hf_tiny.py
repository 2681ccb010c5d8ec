"""The tiny Llama and data the Hugging Face examples (hf_accelerate.py, hf_trainer.py) and their
tests share, so the tests can retrain the same thing in one process as a reference."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, SEQ = 128, 16


def tiny_llama_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                       use_cache=False, attn_implementation="sdpa")


def tiny_qwen2_moe_config():
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                          shared_expert_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=SEQ,
                          tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")


def build_model(seed: int = 0, arch: str = "llama") -> torch.nn.Module:
    """A tiny Llama, or with ``arch="qwen2_moe"`` a tiny Qwen2-MoE (routed experts)."""
    torch.manual_seed(seed)
    if arch == "qwen2_moe":
        from transformers import Qwen2MoeForCausalLM

        return Qwen2MoeForCausalLM(tiny_qwen2_moe_config())
    return LlamaForCausalLM(tiny_llama_config())


def token_rows(n: int, seed: int = 0) -> torch.Tensor:
    """``n`` counting sequences from random starts: learnable, so the loss visibly falls."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB, (n, 1), generator=g)
    return (starts + torch.arange(SEQ)) % VOCAB


class CausalLMRows(torch.utils.data.Dataset):
    """Rows as the ``input_ids``/``labels`` dicts Trainer and a plain loop both take."""

    def __init__(self, rows: torch.Tensor):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}
