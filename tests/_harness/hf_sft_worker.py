"""TRL's SFTTrainer on the tiny Llama of examples/hf_tiny.py, run by tests/test_hf_sft.py: with
--deepspeed under torchrun (deepcompile served as ``deepspeed``), or without in one process as the
reference. Rank 0 writes the log history to --out."""

import deepcompile

deepcompile.serve_as_deepspeed()  # before transformers and TRL are imported

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "examples"))  # this file stays in tests/_harness/ (as paths.py)
from hf_tiny import VOCAB, build_model, token_rows  # noqa: E402


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny model's vocabulary: SFTTrainer wants one, though the
    data arrives tokenized; token 0 doubles as padding and end of sequence."""
    vocab = {f"t{i}": i for i in range(VOCAB)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                   pad_token="t0", eos_token="t0", unk_token="t0")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--deepspeed")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--accumulation", type=int, default=1)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    config = SFTConfig(output_dir=args.output_dir, deepspeed=args.deepspeed,
                       per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=args.accumulation,
                       learning_rate=1e-2, weight_decay=0.0, lr_scheduler_type="constant", num_train_epochs=1,
                       logging_steps=1, save_strategy="no", report_to=[], seed=0, disable_tqdm=True,
                       max_length=None, eos_token="t0", pad_token="t0", bf16=False,
                       gradient_checkpointing=False)
    rows = token_rows(args.rows, seed=0)
    data = Dataset.from_dict({"input_ids": rows.tolist()})
    trainer = SFTTrainer(model=build_model(seed=0), args=config, train_dataset=data,
                         processing_class=tiny_tokenizer())
    trainer.train()
    if trainer.is_world_process_zero():
        with open(args.out, "w") as f:
            json.dump({"log_history": trainer.state.log_history, "world_size": config.world_size,
                       "engine": type(trainer.model_wrapped).__module__}, f)


if __name__ == "__main__":
    main()
