"""The model zoo of tests/clients/test_model_zoo.py: tiny configurations of the architectures
transformers' DeepSpeed model-zoo test covers (hidden size 32, 2 layers, a vocabulary of 96, each
built from its config class with the config's own dropout), the data each trains on, and the
worker that trains them with transformers' Trainer:

    torchrun --nproc-per-node 2 tests/_harness/zoo_worker.py --archs gpt2,bert,t5 --out-dir D
    python tests/_harness/zoo_worker.py --reference --archs gpt2,bert,t5 --out-dir D

Under torchrun deepcompile is served as ``deepspeed`` and each rank trains, one architecture
after the other in the same processes, at ZeRO-3 (examples/ds_config_zero3.json, compiled as the
served engine compiles by default: Inductor), fp32:

* ``dropout``: the configuration's own dropout probabilities (only where its model uses a
  non-zero one; otherwise this run would be the next one again);
* ``no_dropout``: every dropout probability of the configuration set to 0.

With ``--reference``, one process without DeepSpeed trains each architecture without dropout on
the global batch (WORLD * MICRO rows a step): ``reference``.

Rank 0 writes ``D/<arch>.<run>.pt``: the logged losses and grad norms, the initial and final
parameters (fp32; under ZeRO-3 gathered by accelerate's ``get_state_dict``), the engine that ran
and how it compiled. A run that raises writes ``D/<arch>.<run>.rank<r>.error.json`` (error class,
message, traceback) on each rank where it raised, and the worker goes on with the next run.

Importing this module imports torch only (transformers' classes are imported where the cases are
built), so that the worker serves deepcompile before transformers is imported.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Tuple

import torch

VOCAB, SEQ, HIDDEN, LAYERS, HEADS, FFN = 96, 16, 32, 2, 4, 64
NUM_LABELS, IMAGE, PATCH = 4, 8, 4
WORLD, MICRO, STEPS = 2, 2, 3
ROWS = WORLD * MICRO * STEPS  # one epoch of STEPS optimizer steps, no accumulation
LR = 5e-3
MAX_GRAD_NORM = 1.0  # Trainer's default: the served engine clips at it ("auto" gradient_clipping)
MODEL_SEED, DATA_SEED = 1234, 7


# ---- the architectures: (model class name, task, config) ----------------------------------------------------


def _gpt2():
    from transformers import GPT2Config

    return "GPT2LMHeadModel", "causal", GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=LAYERS,
                                                   n_head=HEADS, n_inner=FFN, bos_token_id=VOCAB - 1,
                                                   eos_token_id=VOCAB - 1)


def _bert():
    from transformers import BertConfig

    return "BertForSequenceClassification", "classify", BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=FFN, max_position_embeddings=SEQ, num_labels=NUM_LABELS)


def _t5():
    from transformers import T5Config

    return "T5ForConditionalGeneration", "seq2seq", T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=FFN, num_layers=LAYERS,
        num_decoder_layers=LAYERS, num_heads=HEADS, relative_attention_num_buckets=8, pad_token_id=0,
        eos_token_id=1, decoder_start_token_id=0)


def _bart():
    from transformers import BartConfig

    return "BartForConditionalGeneration", "seq2seq", BartConfig(
        vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS,
        encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN,
        max_position_embeddings=SEQ, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
        forced_eos_token_id=2)


def _opt():
    from transformers import OPTConfig

    return "OPTForCausalLM", "causal", OPTConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, ffn_dim=FFN, num_attention_heads=HEADS,
        max_position_embeddings=SEQ, word_embed_proj_dim=HIDDEN, pad_token_id=1, bos_token_id=2, eos_token_id=2)


def _gpt_neox():
    from transformers import GPTNeoXConfig

    return "GPTNeoXForCausalLM", "causal", GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=FFN, max_position_embeddings=SEQ, use_cache=False)


def _llama():
    from transformers import LlamaConfig

    return "LlamaForCausalLM", "causal", LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=SEQ, use_cache=False)


def _qwen2():
    from transformers import Qwen2Config

    return "Qwen2ForCausalLM", "causal", Qwen2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=SEQ, use_cache=False)


def _mistral():
    from transformers import MistralConfig

    return "MistralForCausalLM", "causal", MistralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=SEQ, use_cache=False)


def _gemma():
    from transformers import GemmaConfig

    return "GemmaForCausalLM", "causal", GemmaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=2, head_dim=HIDDEN // HEADS, max_position_embeddings=SEQ,
        use_cache=False)


def _phi():
    from transformers import PhiConfig

    return "PhiForCausalLM", "causal", PhiConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, max_position_embeddings=SEQ, use_cache=False)


def _mixtral():
    from transformers import MixtralConfig

    return "MixtralForCausalLM", "causal", MixtralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=SEQ, use_cache=False)


def _vit():
    from transformers import ViTConfig

    return "ViTForImageClassification", "image", ViTConfig(
        image_size=IMAGE, patch_size=PATCH, num_channels=3, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, intermediate_size=FFN, num_labels=NUM_LABELS)


ARCHS: Dict[str, Callable[[], Tuple[str, str, Any]]] = {
    "gpt2": _gpt2, "bert": _bert, "t5": _t5, "bart": _bart, "opt": _opt, "gpt_neox": _gpt_neox,
    "llama": _llama, "qwen2": _qwen2, "mistral": _mistral, "gemma": _gemma, "phi": _phi, "mixtral": _mixtral,
    "vit": _vit,
}


def dropout_keys(config) -> Dict[str, float]:
    """The configuration's dropout probabilities: every float attribute named ``*drop*``
    (``resid_pdrop``, ``hidden_dropout_prob``, ``dropout_rate``, ``attention_dropout``, BART's and
    OPT's ``layerdrop``, ...)."""
    return {k: float(v) for k, v in config.to_dict().items()
            if "drop" in k and isinstance(v, float) and not isinstance(v, bool)}


# Dropout of heads the zoo does not build (GPT-2's sequence summary, GPT-NeoX's classifier): set to
# 0 with the others, but not counted as active dropout of a causal LM.
_HEAD_ONLY = ("classifier_dropout", "summary_first_dropout")


def config_for(arch: str, dropout: bool):
    """(model class name, task, config) of ``arch``; ``dropout=False``: every dropout probability 0."""
    cls_name, task, config = ARCHS[arch]()
    if not dropout:
        for k in dropout_keys(config):
            setattr(config, k, 0.0)
    return cls_name, task, config


def active_dropout(arch: str) -> Dict[str, float]:
    """The non-zero dropout probabilities of ``arch``'s default configuration that its model uses."""
    _, task, config = config_for(arch, True)
    return {k: v for k, v in dropout_keys(config).items()
            if v > 0 and (task == "classify" or k not in _HEAD_ONLY)}


def build_model(arch: str, dropout: bool) -> torch.nn.Module:
    import transformers

    cls_name, _, config = config_for(arch, dropout)
    torch.manual_seed(MODEL_SEED)
    return getattr(transformers, cls_name)(config)


# ---- the data: rows of the batch Trainer's default collator stacks -----------------------------------------


def rows(arch: str) -> List[Dict[str, torch.Tensor]]:
    """ROWS learnable examples for ``arch``'s task, every one with the same number of loss terms
    (all label tokens count), so the mean of the ranks' mean losses is the global batch's mean.

    * causal: counting sequences from random starts, ``labels = input_ids``;
    * seq2seq: the same inputs, the labels their successors (``(t + 1) % VOCAB``);
    * classify: random tokens from one of NUM_LABELS quarters of the vocabulary, labelled by it;
    * image: noise plus a per-class pattern, labelled by the class."""
    task = ARCHS[arch]()[1]
    g = torch.Generator().manual_seed(DATA_SEED)
    starts = torch.randint(3, VOCAB, (ROWS, 1), generator=g)
    ids = (starts + torch.arange(SEQ)) % VOCAB
    classes = torch.randint(0, NUM_LABELS, (ROWS,), generator=g)
    if task == "causal":
        return [{"input_ids": r, "labels": r.clone()} for r in ids]
    if task == "seq2seq":
        return [{"input_ids": r, "labels": (r + 1) % VOCAB} for r in ids]
    if task == "classify":
        width = VOCAB // NUM_LABELS
        ids = classes[:, None] * width + torch.randint(0, width, (ROWS, SEQ), generator=g)
        return [{"input_ids": r, "labels": c} for r, c in zip(ids, classes)]
    assert task == "image", task
    patterns = torch.randn(NUM_LABELS, 3, IMAGE, IMAGE, generator=g)
    noise = 0.5 * torch.randn(ROWS, 3, IMAGE, IMAGE, generator=g)
    return [{"pixel_values": patterns[c] + n, "labels": c} for c, n in zip(classes, noise)]


class Rows(torch.utils.data.Dataset):
    def __init__(self, items: List[Dict[str, torch.Tensor]]):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return self.items[i]


def chance_loss(arch: str) -> float:
    """The cross-entropy of a uniform guess over the task's classes (the vocabulary for LMs)."""
    return math.log(NUM_LABELS if ARCHS[arch]()[1] in ("classify", "image") else VOCAB)


# ---- the worker (torchrun) --------------------------------------------------------------------------------


def _ds_config(backend: str) -> Dict[str, Any]:
    """examples/ds_config_zero3.json (transformers' documented ZeRO-3 config: "auto" sizes and
    clipping, bf16 "auto", which the fp32 TrainingArguments turn off); compiled as served
    (compile.auto_compile), with ``backend`` (the served default: inductor)."""
    import json
    import os

    from _harness import paths

    with open(os.path.join(paths.ROOT, "examples", "ds_config_zero3.json")) as f:
        config = json.load(f)
    if backend != "inductor":
        config["compile"] = {"backend": backend}
    return config


def _train(arch: str, dropout: bool, args) -> Dict[str, Any]:
    """One Trainer run of ``arch``: with ``args.reference``, in one process without DeepSpeed on
    the global batch (WORLD * MICRO rows), else at ZeRO-3 on deepcompile, MICRO rows per rank."""
    from transformers import Trainer, TrainingArguments

    model = build_model(arch, dropout)  # before TrainingArguments: built whole, as the reference builds it
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    targs = TrainingArguments(
        output_dir=f"{args.out_dir}/{arch}", deepspeed=None if args.reference else _ds_config(args.compile_backend),
        per_device_train_batch_size=MICRO * WORLD if args.reference else MICRO, gradient_accumulation_steps=1,
        learning_rate=LR, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, optim="adamw_torch",
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=MAX_GRAD_NORM, num_train_epochs=1,
        logging_steps=1, save_strategy="no", report_to=[], seed=0, disable_tqdm=True, bf16=False, fp16=False,
        # Rank r trains the loader's batches r, r + W, ...: step k trains rows [k*W*MICRO, (k+1)*W*MICRO) as the
        # reference's batch k.
        train_sampling_strategy="sequential", dataloader_num_workers=0,
        # True (the default) multiplies every rank's loss by the number of processes for any model whose
        # forward takes **kwargs, expecting the loss to be a share of the global label count; BERT's
        # sequence classification and T5's and BART's LM heads return their own batch's mean (a plain
        # CrossEntropyLoss, num_items_in_batch unused), so on two processes, DDP or DeepSpeed alike, they
        # train on twice the loss (and gradient) one process trains on. False: each rank's loss is its
        # rows' mean, for every model here, and the ranks' average is the global batch's mean.
        average_tokens_across_devices=False)
    trainer = Trainer(model=model, args=targs, train_dataset=Rows(rows(arch)))
    try:
        trainer.train()
        engine = trainer.model_wrapped
        history = trainer.state.log_history
        result = {
            "losses": [e["loss"] for e in history if "loss" in e and "step" in e],
            "grad_norms": [e["grad_norm"] for e in history if "grad_norm" in e and "step" in e],
            "global_step": trainer.state.global_step, "engine": type(engine).__module__,
            "world_size": targs.world_size, "initial": initial,
            "parameters": [name for name, _ in model.named_parameters()],
        }
        if args.reference:
            final = model.state_dict()
        else:
            final = trainer.accelerator.get_state_dict(engine)  # gathered on rank 0 (ZeRO-3: collective)
            compiled = engine.engine.compiled_as
            result.update(stage=engine.engine.stage, compiled=compiled.describe() if compiled is not None else None)
        result["final"] = {k: v.detach().float().clone() for k, v in final.items()}
    finally:
        _release(trainer)
    return result


def _release(trainer) -> None:
    """What one run leaves behind that the next must not meet: the engine (compiled graphs,
    hooks), transformers' global ZeRO-3 flag, accelerate's singleton state, Dynamo's caches."""
    import gc

    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    engine = getattr(trainer, "model_wrapped", None)
    if engine is not None and hasattr(engine, "destroy"):
        engine.destroy()
    unset_hf_deepspeed_config()
    AcceleratorState._reset_state(reset_partial_state=False)
    torch._dynamo.reset()
    gc.collect()


def main() -> None:
    import argparse
    import datetime
    import json
    import os
    import time
    import traceback

    p = argparse.ArgumentParser()
    p.add_argument("--archs", required=True, help="comma-separated names of ARCHS")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--compile-backend", default="inductor", choices=["inductor", "eager"])
    p.add_argument("--reference", action="store_true",
                   help="one process, no DeepSpeed, every dropout 0: writes <arch>.reference.pt")
    args = p.parse_args()
    rank = 0
    if not args.reference:
        import deepcompile

        deepcompile.serve_as_deepspeed()  # before transformers' Trainer is imported
        import torch.distributed as dist

        # The group before accelerate's: a run that fails on one rank only must not leave the other
        # waiting in a collective for gloo's default 30 minutes.
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=480))
        rank = dist.get_rank()
    for arch in args.archs.split(","):
        if args.reference:
            runs = ["reference"]
        else:
            runs = (["dropout"] if active_dropout(arch) else []) + ["no_dropout"]
        for run in runs:
            started = time.perf_counter()
            try:
                result = _train(arch, run == "dropout", args)
            except Exception as e:  # recorded for the test, which reports it; the next run goes on
                with open(os.path.join(args.out_dir, f"{arch}.{run}.rank{rank}.error.json"), "w") as f:
                    json.dump({"type": f"{type(e).__module__}.{type(e).__qualname__}", "message": str(e),
                               "traceback": traceback.format_exc()}, f)
                print(f"[zoo rank {rank}] {arch}.{run} failed: {type(e).__name__}: {str(e)[:500]}", flush=True)
                continue
            result["seconds"] = time.perf_counter() - started
            if rank == 0:
                torch.save(result, os.path.join(args.out_dir, f"{arch}.{run}.pt"))
                print(f"[zoo] {arch}.{run}: losses {result['losses']} in {result['seconds']:.1f} s", flush=True)
    if not args.reference:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: _harness imports
    main()
