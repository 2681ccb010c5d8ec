"""DeepSpeed's ALST / Ulysses route on deepcompile, run by tests/integrations/test_served_ulysses.py
under torchrun: accelerate's ``ParallelismConfig(sp_backend="deepspeed", sp_size=2)`` with

* ``--mode accelerate``: accelerate's own example loop (test_ds_alst_ulysses_sp.py: the adapter
  from ``prepare``, the loss from ``shift_labels`` recombined over ``groups._get_sequence_parallel_group()``);
* ``--mode trainer``: transformers' Trainer given the same parallelism config
  (``TrainingArguments(parallelism_config=...)``: its ``deepspeed_ulysses_dl_adapter`` and
  ``deepspeed_sp_compute_loss``).

Rank 0 writes the loss of every step and the final parameters (fp32) to --out.
"""

import deepcompile

deepcompile.serve_as_deepspeed()  # before transformers and accelerate are imported

import argparse  # noqa: E402
import json  # noqa: E402

import torch  # noqa: E402

from ulysses_case import LR, MICRO_BATCH, ROWS, SEQUENCE, ds_config, positions, rows, tiny_llama_sdpa  # noqa: E402


def parallelism_config(sp: int):
    from accelerate.utils import ParallelismConfig
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig

    return ParallelismConfig(sp_backend="deepspeed", sp_size=sp, sp_handler=DeepSpeedSequenceParallelConfig(
        sp_seq_length=SEQUENCE, sp_seq_length_is_variable=False, sp_attn_implementation="sdpa"))


def run_accelerate(args):
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    pc = parallelism_config(args.sp)
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config(args.stage)),
                              parallelism_config=pc)
    data = rows(args.rows)

    def collate(items):
        ids = torch.stack([x[0] for x in items])
        return {"input_ids": ids, "labels": ids.clone(),
                "position_ids": torch.arange(SEQUENCE).expand(len(items), SEQUENCE).clone()}

    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=args.micro_batch,
                                     collate_fn=collate)
    model = tiny_llama_sdpa()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    model, optimizer, dl = accelerator.prepare(model, optimizer, dl)
    unwrapped = accelerator.unwrap_model(model)
    from deepspeed.utils import groups

    sp_group = groups._get_sequence_parallel_group()
    losses = []
    for batch in dl:
        optimizer.zero_grad()
        outputs = model(**batch)
        shift_labels = batch["shift_labels"]
        loss = unwrapped.loss_function(logits=outputs.logits, labels=None, shift_labels=shift_labels,
                                       vocab_size=unwrapped.config.vocab_size)
        # accelerate's example: the slices' means recombined by their token counts, differentiably
        per_rank = torch.distributed.nn.functional.all_gather(loss, group=sp_group)
        good = (shift_labels != -100).view(-1).sum()
        good_per_rank = torch.distributed.nn.functional.all_gather(good, group=sp_group)
        total = sum(per_rank[r] * good_per_rank[r] for r in range(args.sp) if good_per_rank[r] > 0)
        loss = total / max(sum(good_per_rank), 1)
        accelerator.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    # An evaluation forward runs the module uncompiled (no all-to-alls): a slice must be refused.
    model.eval()
    try:
        model(**batch)
        eval_refusal = None
    except RuntimeError as e:
        eval_refusal = str(e)
    model.train()
    state = accelerator.get_state_dict(model)
    return {"losses": losses, "loader_length": len(dl), "engine": type(model).__module__, "eval_refusal": eval_refusal,
            "sequence_parallel_size": model.engine.sequence_parallel.size,
            "rewritten_calls": model.engine.sequence_parallel.rewritten_calls}, state


def run_trainer(args):
    from datasets import Dataset
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Losses(TrainerCallback):
        def __init__(self):
            self.losses = []

        def on_log(self, targs, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(logs["loss"])

    targs = TrainingArguments(output_dir=args.output_dir, deepspeed=ds_config(args.stage, args.packed),
                              parallelism_config=parallelism_config(args.sp),
                              per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=1,
                              learning_rate=args.lr, weight_decay=0.0, lr_scheduler_type="constant",
                              max_grad_norm=0.0, num_train_epochs=1, logging_steps=1, save_strategy="no",
                              report_to=[], seed=0, disable_tqdm=True, bf16=False,
                              train_sampling_strategy="sequential")
    data = rows(args.rows)
    dataset = Dataset.from_dict({"input_ids": data.tolist(), "labels": data.tolist(),
                                 "position_ids": [positions(args.packed)] * args.rows})
    callback = Losses()
    trainer = Trainer(model=tiny_llama_sdpa(), args=targs, train_dataset=dataset, callbacks=[callback])
    trainer.train()
    engine = trainer.model_wrapped
    state = trainer.accelerator.get_state_dict(engine)
    return {"losses": callback.losses, "engine": type(engine).__module__,
            "sequence_parallel_size": engine.engine.sequence_parallel.size,
            "rewritten_calls": engine.engine.sequence_parallel.rewritten_calls,
            "global_steps": trainer.state.global_step}, state


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["accelerate", "trainer"], required=True)
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--sp", type=int, default=2)
    p.add_argument("--rows", type=int, default=ROWS)
    p.add_argument("--micro-batch", type=int, default=MICRO_BATCH)
    p.add_argument("--lr", type=float, default=LR)
    p.add_argument("--packed", action="store_true", help="trainer mode: packed rows (compile.packed_sequences)")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    result, state = (run_accelerate if args.mode == "accelerate" else run_trainer)(args)
    if torch.distributed.get_rank() == 0:
        result["params"] = {k: v.float().tolist() for k, v in state.items()}
        result["world_size"] = torch.distributed.get_world_size()
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
