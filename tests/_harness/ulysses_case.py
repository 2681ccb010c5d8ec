"""The model, data and configs of the ALST / Ulysses route tests (test_served_ulysses.py): shared by
the served worker (hf_ulysses_worker.py) and the one-process reference, which must not serve
deepcompile as ``deepspeed``."""

from __future__ import annotations

from typing import Any, Dict, List

import torch

SEQUENCE, VOCAB = 16, 61
ROWS, MICRO_BATCH, LR = 8, 2, 1e-2


def tiny_llama_sdpa(attn_implementation: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, attn_implementation=attn_implementation)
    return LlamaForCausalLM(cfg)


def rows(count: int = ROWS) -> torch.Tensor:
    return torch.randint(0, VOCAB, (count, SEQUENCE), generator=torch.Generator().manual_seed(77))


# Packed rows: three documents of 5, 7 and 4 tokens (positions restarting), one crossing the slices' boundary.
PACKED_DOCUMENTS = (5, 7, 4)


def positions(packed: bool) -> List[int]:
    return [p for n in PACKED_DOCUMENTS for p in range(n)] if packed else list(range(SEQUENCE))


def ds_config(stage: int, packed: bool = False) -> Dict[str, Any]:
    """fp32 (no bf16/fp16 section), no clipping, one micro-step per step, compiled with the eager
    backend (the pass is the same; Inductor would only cost time)."""
    return {"zero_optimization": {"stage": stage, "reduce_bucket_size": 256,
                                  "stage3_gather_16bit_weights_on_model_save": True},
            "gradient_accumulation_steps": 1, "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "compile": {"backend": "eager", **({"packed_sequences": True} if packed else {})}, "steps_per_print": 1000}


def reference(count: int = ROWS, micro_batch: int = MICRO_BATCH, lr: float = LR, packed: bool = False
              ) -> Dict[str, Any]:
    """One process, whole sequences: one AdamW step per batch of ``micro_batch`` rows, in the data's
    order. The sequence-parallel runs train the same batches in the same order: accelerate gives
    rank r the loader's batches r, r + 2, ... and the adapter trains the group's batches in rank
    order, so step k trains batch k."""
    model = tiny_llama_sdpa()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    data = rows(count)
    losses: List[float] = []
    for first in range(0, count, micro_batch):
        batch = data[first:first + micro_batch]
        position_ids = torch.tensor(positions(packed)).expand_as(batch)  # packed: transformers masks by document
        loss = model(input_ids=batch, labels=batch, position_ids=position_ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.named_parameters()}}
