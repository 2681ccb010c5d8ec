"""The model, LoRA adapters, data and settings of the LLaVA/FastChat/Qwen-style LoRA run
(tests/_harness/hf_lora_save_worker.py) that tests/integrations/test_served_lora_save.py retrains
in one process as its reference.

Imports neither deepcompile's served package nor Lightning: the test process may have imported
transformers already, after which nothing may be served as ``deepspeed`` there. transformers and
PEFT are imported inside the functions, so the worker imports this module only after it served
deepcompile as ``deepspeed``.
"""

from __future__ import annotations

import torch

VOCAB, SEQ, HIDDEN = 64, 16, 32
WORLD, MICRO, STEPS, LR = 2, 2, 3, 1e-2
ROWS = WORLD * MICRO * STEPS  # one epoch of STEPS optimizer steps, no accumulation
LORA_TARGETS = ["q_proj", "v_proj"]
NON_LORA_FILE = "non_lora_trainables.bin"


def build_base() -> torch.nn.Module:
    """The tiny Llama, the same weights every time it is built (seeded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
                         tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, lora_dropout=0.0, bias="none",
                      task_type="CAUSAL_LM")


def build_peft_model() -> torch.nn.Module:
    """build_base() with the LoRA adapters, and lm_head trained whole beside them: the non-LoRA
    trainable part, as LLaVA's mm_projector (the scripts turn requires_grad on for it after
    get_peft_model and save it apart from the adapters, in non_lora_trainables.bin). Not PEFT's
    modules_to_save: save_pretrained(state_dict=lora_state) looks for modules_to_save entries in the
    state dict it is given, which the scripts' LoRA-only state dict lacks (a KeyError in PEFT).

    lora_A is set from its own seeded generator.

    PEFT draws lora_A (kaiming-uniform) from the global generator, whose state depends on what
    ran before in the process (NOTES.md: under ZeRO-3, from_pretrained + LoRA draws it from
    another state than the run without DeepSpeed). Setting it here from a fixed generator makes
    the distributed run and the single-process reference start from the same adapters whatever
    consumed random numbers before. lora_B stays PEFT's zeros: a trained lora_B is then non-zero
    only because training moved it, so a saved zero lora_B means the trained values were lost.
    """
    from peft import get_peft_model

    model = get_peft_model(build_base(), lora_config())
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    model.base_model.model.lm_head.weight.requires_grad_(True)
    return model


def token_rows() -> torch.Tensor:
    """ROWS counting sequences from random starts (learnable: the loss falls)."""
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, VOCAB, (ROWS, 1), generator=g)
    return (starts + torch.arange(SEQ)) % VOCAB


class Rows(torch.utils.data.Dataset):
    def __init__(self, rows: torch.Tensor):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def reference():
    """The same training in one process with plain PyTorch on the same global batches: the worker's
    Trainer reads the rows in order (a sequential sampler), so optimizer step s of the 2-rank run
    sees rows [s*W*mb, (s+1)*W*mb), rank r the r-th micro-batch of them; each rank's loss is the
    mean over the same number of tokens, so the averaged gradient is the whole batch's. AdamW
    (Trainer's default, fused, lr constant, no weight decay), gradients clipped to 1.0 (Trainer's
    max_grad_norm, which fills the config's "auto" gradient_clipping). Returns the trained model
    and the per-step losses."""
    model = build_peft_model()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.0, fused=True)
    rows = token_rows()
    losses = []
    for s in range(STEPS):
        batch = rows[s * WORLD * MICRO:(s + 1) * WORLD * MICRO]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, losses
