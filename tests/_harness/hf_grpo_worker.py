"""TRL's GRPOTrainer on the tiny Llama of examples/hf_tiny.py under ZeRO-3 (deepcompile served as
``deepspeed``), run by tests/integrations/test_served_generation.py under torchrun. Every
completion is generated inside TRL's ``unwrap_model_for_generation``: the whole policy gathered by
``GatheredParameters``, DeepSpeed's module hooks removed through
``engine.optimizer.parameter_offload`` and put back after. The worker counts the parameters the
engine's eager hooks gather while ``generate`` runs (none: the block gathered them already) and
checks that the weights generation sees are the full, finite ones; rank 0 writes the record."""

import deepcompile

deepcompile.serve_as_deepspeed()  # before transformers and TRL are imported

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from deepcompile.zero import eager_fallback  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples"))
from hf_dpo_worker import tiny_tokenizer  # noqa: E402
from hf_tiny import VOCAB, build_model  # noqa: E402


def reward_len(completions, **kwargs):
    """A stub reward: longer completions score higher (GRPO only needs rewards that differ)."""
    return [float(len(c)) for c in completions]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--deepspeed", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    # With beta > 0 GRPO builds its reference model from the policy's path (a model given as an
    # object has none): both come from save_pretrained files, the reference a frozen ZeRO-3
    # engine beside the trained one (at ZeRO-2: the stage-0 frozen engine TRL asks for). Each rank writes its own copy (the same weights).
    path = os.path.join(args.output_dir, f"init-rank{os.environ.get('RANK', '0')}")
    build_model(seed=0).save_pretrained(path)  # before GRPOConfig: not inside the served zero.Init
    config = GRPOConfig(output_dir=args.output_dir, deepspeed=args.deepspeed, per_device_train_batch_size=2,
                        num_generations=2, max_completion_length=4, learning_rate=1e-2, max_steps=2,
                        logging_steps=1, save_strategy="no", report_to=[], seed=0, disable_tqdm=True, bf16=False,
                        beta=0.04)
    prompts = {"prompt": [" ".join(f"t{1 + (k + i) % (VOCAB - 1)}" for i in range(4)) for k in range(8)]}
    trainer = GRPOTrainer(model=path, reward_funcs=reward_len, args=config,
                          train_dataset=Dataset.from_dict(prompts), processing_class=tiny_tokenizer())

    counts = {"generate_calls": 0, "eager_gathers_in_generate": 0, "full_finite_weights": True,
              "hooks_suspended_in_generate": True}
    real_gather = eager_fallback.gather_full_copy
    inside = {"generating": False}

    def counting_gather(placeholder, ds_id):
        if inside["generating"]:
            counts["eager_gathers_in_generate"] += 1
        return real_gather(placeholder, ds_id)

    eager_fallback.gather_full_copy = counting_gather
    model = trainer.model  # the HF module; TRL generates with the module the engine wraps
    real_generate = model.generate

    def generate(*a, **kw):
        counts["generate_calls"] += 1
        # ZeRO-3 only, as in DeepSpeed: at ZeRO-2 the weights are whole and nothing is gathered.
        offload = getattr(trainer.model_wrapped.optimizer, "parameter_offload", None)
        if offload is not None:
            counts["hooks_suspended_in_generate"] &= offload.hooks_suspended
        shapes = [getattr(p, "ds_shape", p.shape) for p in model.parameters()]
        counts["full_finite_weights"] &= all(
            tuple(p.shape) == tuple(s) and bool(torch.isfinite(p).all()) for p, s in zip(model.parameters(), shapes))
        inside["generating"] = True
        try:
            return real_generate(*a, **kw)
        finally:
            inside["generating"] = False

    model.generate = generate
    trainer.train()
    offload = getattr(trainer.model_wrapped.optimizer, "parameter_offload", None)
    counts["hooks_suspended_after"] = None if offload is None else offload.hooks_suspended
    if trainer.is_world_process_zero():
        with open(args.out, "w") as f:
            json.dump({"log_history": trainer.state.log_history, "counts": counts,
                       "stage": trainer.model_wrapped.zero_optimization_stage(),
                       "ref_engine": type(trainer.ref_model).__module__}, f)


if __name__ == "__main__":
    main()
