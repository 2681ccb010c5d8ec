"""TRL's DPOTrainer with a separate reference model on the tiny Llama of examples/hf_tiny.py, run
by tests/integrations/test_served_frozen_engine.py under torchrun with --deepspeed (deepcompile
served as ``deepspeed``): the reference model goes through TRL's ``prepare_deepspeed``. Rank 0
writes the log history and what the reference model became to --out."""

import deepcompile

deepcompile.serve_as_deepspeed()  # before transformers and TRL are imported

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from trl import DPOConfig, DPOTrainer  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "examples"))  # this file stays in tests/_harness/ (as paths.py)
from hf_tiny import VOCAB, build_model  # noqa: E402


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level over the tiny model's vocabulary, split on spaces (DPO tokenizes text)."""
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t0", unk_token="t0")


def preference_rows(n: int):
    """Prompts with a chosen and a rejected continuation: the chosen one always counts up."""
    def words(ids):
        return " ".join(f"t{1 + i % (VOCAB - 1)}" for i in ids)

    return {"prompt": [words(range(k, k + 4)) for k in range(n)],
            "chosen": [words(range(k + 4, k + 8)) for k in range(n)],
            "rejected": [words(range(k + 40, k + 36, -1)) for k in range(n)]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--deepspeed", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    config = DPOConfig(output_dir=args.output_dir, deepspeed=args.deepspeed, per_device_train_batch_size=2,
                       gradient_accumulation_steps=1, learning_rate=1e-2, lr_scheduler_type="constant", max_steps=2,
                       logging_steps=1, save_strategy="no", report_to=[], seed=0, disable_tqdm=True, bf16=False,
                       max_length=16)
    trainer = DPOTrainer(model=build_model(seed=0), ref_model=build_model(seed=0), args=config,
                         train_dataset=Dataset.from_dict(preference_rows(8)), processing_class=tiny_tokenizer())
    ref = trainer.ref_model
    trainer.train()
    if trainer.is_world_process_zero():
        with open(args.out, "w") as f:
            json.dump({"log_history": trainer.state.log_history, "ref_engine": type(ref).__name__,
                       "ref_stage": ref.zero_optimization_stage(), "engine": type(trainer.model_wrapped).__module__}, f)


if __name__ == "__main__":
    main()
