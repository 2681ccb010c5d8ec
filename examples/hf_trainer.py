"""A transformers Trainer script with DeepSpeed ZeRO-3, running on deepcompile.

    torchrun --nproc-per-node 2 examples/hf_trainer.py --deepspeed examples/ds_config_zero3.json

The script is an ordinary Trainer script; the only deepcompile-specific lines are the two at the
top, which must run before transformers' Trainer is imported. It trains a tiny Llama (logging
loss and grad norm every step), evaluates, and saves the model (full 16-bit weights, from the
config's stage3_gather_16bit_weights_on_model_save) for ``from_pretrained``. Without --deepspeed
it is the same run without DeepSpeed (the tests' single-process reference). --mics-shard-size S
turns on hybrid sharding (partitions over groups of S ranks, replicated across the groups). With
--out, rank 0 writes the log history and evaluation metrics to a JSON file.

deepcompile compiles the engine whether or not Trainer's torch_compile is set (the config's
compile.auto_compile; --no-auto-compile turns it off), and logs once on rank 0 what runs: stage,
dtypes, offload and how it is compiled. --bf16/--fp16 train in that precision (the config's
"auto" follows them), on the CPU too.
"""

import deepcompile

deepcompile.serve_as_deepspeed()  # `import deepspeed` is now deepcompile: Trainer's DeepSpeed path runs on it

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_tiny import CausalLMRows, build_model, tiny_llama_config, token_rows  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--deepspeed", help="DeepSpeed config file (absent: no DeepSpeed)")
    p.add_argument("--output-dir", default="out/hf_trainer")
    p.add_argument("--rows", type=int, default=48)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--accumulation", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=-1)
    p.add_argument("--save-steps", type=int, default=0, help="checkpoint every this many steps (0: never)")
    p.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --output-dir")
    p.add_argument("--arch", default="llama", choices=["llama", "qwen2_moe"])
    p.add_argument("--model-path", help="start from these weights (from_pretrained) instead of a fresh tiny Llama")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--lora", action="store_true", help="train PEFT LoRA adapters (q_proj, v_proj) instead of the model")
    p.add_argument("--eval-only", action="store_true", help="only evaluate (ZeRO inference), no training")
    p.add_argument("--fp16", action="store_true", help="fp16 mixed precision (the config's fp16 \"auto\" follows it)")
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (the config's bf16 \"auto\" follows it)")
    p.add_argument("--from-config", action="store_true",
                   help="build the tiny Llama with AutoModelForCausalLM.from_config (under ZeRO-3: inside zero.Init)")
    p.add_argument("--torch-compile", action="store_true", help="TrainingArguments(torch_compile=True)")
    p.add_argument("--compile-backend", choices=["inductor", "eager"],
                   help="compile.backend in the --deepspeed config: the compiler deepcompile hands its graphs to "
                        "(eager: no code generation, quick on a CPU)")
    p.add_argument("--no-auto-compile", action="store_true",
                   help="compile.auto_compile false in the --deepspeed config: the engine runs uncompiled")
    p.add_argument("--mics-shard-size", type=int,
                   help="hybrid sharding: partition over groups of this many ranks, replicated across the groups "
                        "(sets zero_optimization.mics_shard_size in the --deepspeed config)")
    p.add_argument("--out")
    args = p.parse_args()

    edits = {}
    if args.mics_shard_size is not None:
        edits[("zero_optimization", "mics_shard_size")] = args.mics_shard_size
    if args.compile_backend:
        edits[("compile", "backend")] = args.compile_backend
    if args.no_auto_compile:
        edits[("compile", "auto_compile")] = False
    if edits:
        if not args.deepspeed:
            p.error("--mics-shard-size, --compile-backend and --no-auto-compile need --deepspeed")
        with open(args.deepspeed) as f:
            args.deepspeed = json.load(f)  # Trainer takes the config as a dict as well as a file
        for (section, key), value in edits.items():
            args.deepspeed.setdefault(section, {})[key] = value

    training_args = TrainingArguments(
        output_dir=args.output_dir,
        deepspeed=args.deepspeed,
        per_device_train_batch_size=args.micro_batch,
        per_device_eval_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.accumulation,
        learning_rate=1e-2,
        weight_decay=0.0,
        warmup_steps=2,
        lr_scheduler_type="linear",
        num_train_epochs=1,
        max_steps=args.max_steps,
        logging_steps=1,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to=[],
        seed=0,
        disable_tqdm=True,
        gradient_checkpointing=args.gradient_checkpointing,
        fp16=args.fp16,
        bf16=args.bf16,
        torch_compile=args.torch_compile,
        torch_compile_backend=args.compile_backend if args.torch_compile else None,
        # Trainer refuses bf16 on a machine without a GPU unless it is told to train on the CPU.
        use_cpu=args.bf16 and not torch.cuda.is_available(),
    )
    # After TrainingArguments, as in transformers' examples: under ZeRO-3, from_pretrained then
    # builds the model inside deepspeed.zero.Init.
    if args.model_path:
        model = AutoModelForCausalLM.from_pretrained(args.model_path)
    elif args.from_config:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_llama_config())
    else:
        model = build_model(seed=0, arch=args.arch)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 lora_dropout=0.0))
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=CausalLMRows(token_rows(args.rows, seed=0)),
        eval_dataset=CausalLMRows(token_rows(8, seed=1)),
    )
    if not args.eval_only:
        trainer.train(resume_from_checkpoint=True if args.resume else None)
    metrics = trainer.evaluate()
    if not args.eval_only:
        trainer.save_model(os.path.join(args.output_dir, "model"))

    if trainer.is_world_process_zero() and args.out:
        with open(args.out, "w") as f:
            json.dump({"log_history": trainer.state.log_history, "eval": metrics,
                       "world_size": training_args.world_size,
                       "engine": type(trainer.model_wrapped).__module__}, f)


if __name__ == "__main__":
    main()
