"""A LLaVA/FastChat/Qwen-style LoRA fine-tuning script (transformers' Trainer, PEFT adapters on
q_proj/v_proj and a trainable lm_head beside them) with its end-of-training save, run by
tests/integrations/test_served_lora_save.py under torchrun with --deepspeed (a ZeRO-2 or ZeRO-3
config; deepcompile served as ``deepspeed``).

The save is the one those scripts share (written here in our own words): every rank gathers the
``lora_`` parameters and the other trainable ones through ``maybe_zero_3`` (a parameter with
``ds_id`` is partitioned: its ``ds_status`` is read and it is gathered with
``deepspeed.zero.GatheredParameters``, a collective), then rank 0 writes the model config, the
adapters through ``save_pretrained(state_dict=...)`` and the rest to non_lora_trainables.bin.

For the test, rank 0 also writes to --output-dir what the engine itself holds after training
(every parameter inside one whole-model GatheredParameters, and the engine's consolidated state
dict) and, to --out, the log history and how each parameter looked to the save (ds_id,
ds_status, whether its .data outside a gather was the full finite value). Every rank writes the
LoRA state it gathered (the gathers are collective: all ranks must get the same values)."""

import deepcompile

deepcompile.serve_as_deepspeed()  # before transformers is imported

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import SequentialSampler  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

import deepspeed  # noqa: E402  (deepcompile's served package)
from deepspeed import zero  # noqa: E402
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for _harness
from _harness.lora_save_case import (LR, MICRO, NON_LORA_FILE, STEPS, Rows, build_peft_model,  # noqa: E402
                                     token_rows)

log = logging.getLogger("lora_save_worker")
NOT_AVAILABLE_SEEN = []  # names maybe_zero_3 warned about (partitioned when the save began)


# --- the scripts' save helpers, in our own words -------------------------------------------------

def maybe_zero_3(param, name=""):
    """A CPU copy of the parameter's full value, gathered first when ZeRO-3 partitioned it."""
    if hasattr(param, "ds_id"):
        if param.ds_status == ZeroParamStatus.NOT_AVAILABLE:
            NOT_AVAILABLE_SEEN.append(name)
            log.warning("%s is partitioned (ds_status NOT_AVAILABLE); gathering it to save", name)
        with zero.GatheredParameters([param]):
            value = param.data.detach().cpu().clone()
    else:
        value = param.detach().cpu().clone()
    return value


def get_peft_state_maybe_zero_3(named_params, bias="none"):
    """The LoRA parameters (and, with bias "all"/"lora_only", their biases), gathered."""
    if bias == "none":
        picked = {k: t for k, t in named_params if "lora_" in k}
    elif bias == "all":
        picked = {k: t for k, t in named_params if "lora_" in k or "bias" in k}
    elif bias == "lora_only":
        named = dict(named_params)
        picked = {}
        for k, t in named.items():
            if "lora_" in k:
                picked[k] = t
                bias_name = k.split("lora_")[0] + "bias"
                if bias_name in named:
                    picked[bias_name] = named[bias_name]
    else:
        raise NotImplementedError(bias)
    return {k: maybe_zero_3(t, k) for k, t in picked.items()}


def get_peft_state_non_lora_maybe_zero_3(named_params, require_grad_only=True):
    """Every other trainable parameter (LLaVA's projector; lm_head here), gathered."""
    picked = {k: t for k, t in named_params if "lora_" not in k}
    if require_grad_only:
        picked = {k: t for k, t in picked.items() if t.requires_grad}
    return {k: maybe_zero_3(t, k) for k, t in picked.items()}


class SequentialTrainer(Trainer):
    """Rows in order (LLaVA's trainer overrides the sampler too, with a length-grouped one), so
    the test's single-process reference sees the same global batches."""

    def _get_train_sampler(self, *args, **kwargs):
        return SequentialSampler(self.train_dataset)


def _finite_values(data) -> bool:
    """Whether ``data`` holds values, all finite. A ZeRO-3 placeholder refuses the read: False."""
    try:
        return bool(torch.isfinite(data).all())
    except RuntimeError as e:
        if "is partitioned by ZeRO-3" not in str(e):
            raise
        return False


def _probe(named_params):
    """How each parameter looks to the save before it gathers anything."""
    out = {}
    for name, p in named_params:
        full_shape = list(getattr(p, "ds_shape", p.shape))
        data = p.data
        out[name] = {"ds_id": hasattr(p, "ds_id"),
                     "ds_status": p.ds_status.name if hasattr(p, "ds_id") else None,
                     "dc_z12": hasattr(p, "_dc_z12_id"),
                     "requires_grad": p.requires_grad,
                     "full_finite_outside": list(data.shape) == full_shape and _finite_values(data)}
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--deepspeed", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    training_args = TrainingArguments(
        output_dir=args.output_dir, deepspeed=args.deepspeed, per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=1, learning_rate=LR, weight_decay=0.0, lr_scheduler_type="constant",
        warmup_steps=0, max_steps=STEPS, logging_steps=1, save_strategy="no", report_to=[], seed=0,
        disable_tqdm=True, bf16=False, fp16=False)
    model = build_peft_model()
    trainer = SequentialTrainer(model=model, args=training_args, train_dataset=Rows(token_rows()))
    trainer.train()

    probe = _probe(model.named_parameters())
    # The scripts' save: every rank gathers (collective), rank 0 writes.
    lora_state = get_peft_state_maybe_zero_3(model.named_parameters(), bias="none")
    non_lora_state = get_peft_state_non_lora_maybe_zero_3(model.named_parameters())
    rank = dist.get_rank()
    save_dir = os.path.join(args.output_dir, "adapter")
    if training_args.local_rank in (0, -1):
        model.config.save_pretrained(save_dir)
        model.save_pretrained(save_dir, state_dict=lora_state)
        torch.save(non_lora_state, os.path.join(save_dir, NON_LORA_FILE))
    torch.save(lora_state, os.path.join(args.output_dir, f"lora_rank{rank}.pt"))

    # What the engine holds, two other ways: one whole-model gather, and the engine's own
    # consolidated state dict (ZeRO-3's save_model path; at ZeRO-2 each rank holds the full model).
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        gathered = {n: q.data.detach().cpu().clone() for n, q in model.named_parameters()}
    engine = trainer.model_wrapped
    stage = engine.zero_optimization_stage()
    if stage == 3:
        consolidated = engine._zero3_consolidated_16bit_state_dict()
    else:
        consolidated = {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}

    if trainer.is_world_process_zero():
        torch.save(gathered, os.path.join(args.output_dir, "engine_gathered.pt"))
        torch.save(consolidated, os.path.join(args.output_dir, "engine_consolidated.pt"))
        with open(args.out, "w") as f:
            json.dump({"log_history": trainer.state.log_history, "stage": stage,
                       "engine": type(engine).__module__, "world_size": training_args.world_size,
                       "probe": probe, "not_available_warned": NOT_AVAILABLE_SEEN}, f)
    dist.barrier()


if __name__ == "__main__":
    main()
