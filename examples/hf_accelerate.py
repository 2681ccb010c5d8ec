"""An accelerate training loop configured for DeepSpeed ZeRO-3, running on deepcompile.

    torchrun --nproc-per-node 2 examples/hf_accelerate.py --ds-config examples/ds_config_zero3.json
    python -m deepcompile.integrations.accelerate_launch --config_file examples/accelerate_deepspeed.yaml examples/hf_accelerate.py

The second form is `accelerate launch` run through deepcompile, with the same arguments: plain
`accelerate launch` looks for the real DeepSpeed package in the launcher process, before this
script can serve deepcompile as `deepspeed`, and stops with "DeepSpeed is not installed".

The loop is accelerate's ordinary DeepSpeed loop; the only deepcompile-specific lines are the two
at the top, which must run before accelerate is imported. Rank 0 prints the loss (mean over
ranks) per optimizer step and, with --out, writes the losses and learning rates to a JSON file.
"""

import deepcompile

deepcompile.serve_as_deepspeed()  # `import deepspeed` is now deepcompile: accelerate's DeepSpeed path runs on it

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DeepSpeedPlugin  # noqa: E402
from transformers import get_linear_schedule_with_warmup  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_tiny import CausalLMRows, build_model, token_rows  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ds-config", help="DeepSpeed config; without it, the one `accelerate launch` names")
    p.add_argument("--rows", type=int, default=48)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--accumulation", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--state-dir", help="accelerator.save_state here after --state-step optimizer steps")
    p.add_argument("--state-step", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="load_state from --state-dir and continue after it")
    p.add_argument("--out")
    args = p.parse_args()

    plugin = DeepSpeedPlugin(hf_ds_config=args.ds_config) if args.ds_config else None
    accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=args.accumulation)

    model = build_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    loader = torch.utils.data.DataLoader(CausalLMRows(token_rows(args.rows)), batch_size=args.micro_batch)
    # accelerate steps a prepared scheduler once per process per optimizer step: count loader batches.
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2,
                                                num_training_steps=args.epochs * len(loader) // args.accumulation)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    model.train()
    losses, lrs, window = [], [], []
    batches, done = loader, 0
    if args.resume:
        accelerator.load_state(args.state_dir)  # engine (model, optimizer), scheduler, random states
        done = args.state_step
        batches = accelerator.skip_first_batches(loader, done * args.accumulation)
    for epoch in range(args.epochs):
        for batch in batches:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            window.append(accelerator.reduce(loss.detach(), "mean").item())
            if accelerator.sync_gradients:
                losses.append(sum(window) / len(window))
                lrs.append(scheduler.get_last_lr()[0])
                window = []
                accelerator.print(f"step {done + len(losses)}: loss {losses[-1]:.4f}")
                if args.state_dir and not args.resume and done + len(losses) == args.state_step:
                    accelerator.save_state(args.state_dir)
        batches = loader  # a resumed run skipped batches of its first epoch only

    if accelerator.is_main_process and args.out:
        with open(args.out, "w") as f:
            json.dump({"first_step": done + 1, "losses": losses, "lrs": lrs, "world_size": accelerator.num_processes,
                       "engine": type(model).__module__, "summary": getattr(model, "summary_line", None)}, f)
    accelerator.free_memory()  # releases the engine (deepcompile's runtime) before end_training ends the process group
    accelerator.end_training()


if __name__ == "__main__":
    main()
