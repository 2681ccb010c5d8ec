"""Fine-tune a Hugging Face causal language model with deepcompile ZeRO-3: a template to copy.

    torchrun --nproc-per-node 2 examples/finetune.py [--model PATH] [--config examples/finetune_config.json]
                                                     [--out DIR] [--steps N] [--backend inductor|eager] [--cpu]

In order, it shows: the process group on whatever the machine has (NCCL with one GPU per
process, else gloo on the CPU); the model built on the ``meta`` device so that no rank ever holds
all of it; ``deepcompile.initialize`` with the DeepSpeed config file (ZeRO-3, bf16, AdamW and
its warm-up/cosine schedule from the file); the pretrained weights read with
``load_hf_weights`` (each rank reads only its slices); per-layer compilation; a ``DataLoader``
with a ``DistributedSampler``; rank 0's ``steps_per_print`` lines; a checkpoint every
``--save-every`` optimizer steps and a resume from the newest one when ``DIR/checkpoints`` holds
one; and the trained weights written with ``save_hf`` for ``from_pretrained``.

Without ``--model`` it first writes a tiny Llama with ``save_pretrained`` into ``DIR/tiny-pretrained``
and fine-tunes that, so the command runs anywhere. Replace ``TokenRows`` with your tokenised data.

The run stops after ``--steps`` optimizer steps in all (default: the schedule's
``total_num_steps``); run the command again with a larger ``--steps`` and it continues from the
last checkpoint, data position included.

Expected output of the command above on a machine without GPUs (2 ranks on a 2-core CPU,
inductor, the tiny model, 20 steps; timings vary). It took 1.5 to 2.5 minutes there, most of it
the first compile (``--backend eager``: about 40 s)::

    finetune: 2 ranks on cpu; pretrained weights from /tmp/deepcompile-finetune/tiny-pretrained
    [deepcompile] first compile: tracing and compiling the forward ...
    [deepcompile] first compile: tracing and compiling the forward: done in 50.1 s
    [deepcompile] first compile: tracing and compiling the backward ...
    [deepcompile] first compile: tracing and compiling the backward: done in 0.4 s
    [deepcompile] step 4: profiling for the schedule (each graph runs once under the profiler; this step is slower)
    [deepcompile] step 5: lr 0.000991353 | loss 5.3896 | grad norm 0.8029 | tokens/s 99 | peak memory n/a
    [deepcompile] schedule switch at step 5 (step 5: prefetch, selective_gather): 36 prefetch group(s) ...
    [deepcompile] step 10: lr 0.000722208 | loss 4.8867 | grad norm 0.8739 | tokens/s 3886 | peak memory n/a
    finetune: saved checkpoint /tmp/deepcompile-finetune/checkpoints/global_step10
    [deepcompile] step 15: lr 0.000299993 | loss 4.6106 | grad norm 0.759 | tokens/s 3474 | peak memory n/a
    [deepcompile] step 20: lr 0.0001 | loss 4.4927 | grad norm 0.7434 | tokens/s 2438 | peak memory n/a
    finetune: saved checkpoint /tmp/deepcompile-finetune/checkpoints/global_step20
    finetune: trained steps 0 -> 20 in 57.5 s; weights for from_pretrained in /tmp/deepcompile-finetune/final

On 2 x H200 (NCCL) the same command took 49 s, 15 s of it the first compile, and printed the
same losses to the third decimal.

A second run of the same command finds step 20 checkpointed, trains nothing and exports again;
``--steps 30`` continues to step 30.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import deepcompile

HERE = os.path.dirname(os.path.abspath(__file__))


def training_device(force_cpu: bool = False) -> torch.device:
    """This process's GPU when every process of this node can have its own, else the CPU.

    Decided before the process group exists, so that the backend fits the device: NCCL needs one
    GPU per process, and two processes on one GPU would fail at the first collective."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if force_cpu or not torch.cuda.is_available() or torch.cuda.device_count() < local_world:
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def write_tiny_pretrained(directory: str, seq: int) -> None:
    """A stand-in for a downloaded model: a small Llama saved as transformers saves any model."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq)
    LlamaForCausalLM(config).save_pretrained(directory)


class TokenRows(Dataset):
    """Stand-in data: counting sequences from random starts, learnable so the loss visibly falls.
    Replace with your tokenised dataset: items of ``input_ids`` and ``labels``."""

    def __init__(self, rows: int, seq: int, vocab: int):
        g = torch.Generator().manual_seed(1234)
        starts = torch.randint(0, vocab, (rows, 1), generator=g)
        self.tokens = (starts + torch.arange(seq)) % vocab

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int):
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def batches_from(loader: DataLoader, sampler: DistributedSampler, position: dict):
    """``(epoch, batches done in it, batch)`` from a saved position on, epoch after epoch."""
    epoch, skip = position["epoch"], position["batches_done"]
    while True:
        sampler.set_epoch(epoch)  # a different shuffle each epoch, the same on every rank
        for done, batch in enumerate(itertools.islice(loader, skip, None), start=skip + 1):
            yield epoch, done, batch
        epoch, skip = epoch + 1, 0


def build_engine(pretrained: str, ds_config: dict, device: torch.device):
    model_config = AutoConfig.from_pretrained(pretrained)
    # A KV cache filled in the forward makes every layer look different to the compiler.
    model_config.use_cache = False
    # Parameters without storage: each rank materialises only what it keeps (its ZeRO-3 shards
    # and one module at a time), however large the model.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    # optimizer=None: AdamW and its schedule come from the config's "optimizer"/"scheduler".
    # init_fn gives values to what no weights file holds (the rotary embedding's inv_freq buffer).
    return deepcompile.initialize(model, None, ds_config, init_fn=model._init_weights, device=device)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a folder of save_pretrained files (default: a tiny Llama written into --out)")
    parser.add_argument("--config", default=os.path.join(HERE, "finetune_config.json"), help="DeepSpeed config file")
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "deepcompile-finetune"),
                        help="checkpoints/, final/ (the trained weights) and tiny-pretrained/ go here")
    parser.add_argument("--steps", type=int, default=None, help="stop after this many optimizer steps in all "
                        "(default: the schedule's total_num_steps)")
    parser.add_argument("--save-every", type=int, default=10, help="checkpoint every this many optimizer steps")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--rows", type=int, default=512, help="sequences in the stand-in dataset")
    parser.add_argument("--backend", default="inductor", choices=["inductor", "eager"])
    parser.add_argument("--cpu", action="store_true", help="run on the CPU with gloo even where there are GPUs")
    args = parser.parse_args()

    device = training_device(force_cpu=args.cpu)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with open(args.config) as f:
        ds_config = json.load(f)
    total_steps = args.steps or ds_config["scheduler"]["params"]["total_num_steps"]

    pretrained = args.model or os.path.join(args.out, "tiny-pretrained")
    if args.model is None and rank == 0 and not os.path.exists(os.path.join(pretrained, "config.json")):
        write_tiny_pretrained(pretrained, args.seq)
    # The files exist before any rank reads them.
    dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
    if rank == 0:
        print(f"finetune: {world} ranks on {device.type}; pretrained weights from {pretrained}", flush=True)

    engine = build_engine(pretrained, ds_config, device)
    checkpoints = os.path.join(args.out, "checkpoints")
    position = {"epoch": 0, "batches_done": 0}  # where in the data the run stands
    if os.path.exists(os.path.join(checkpoints, "latest")):
        # Weights, optimizer and schedule state, step counters and random generators; any world
        # size or stage may have written it.
        path, client_state = engine.load_checkpoint(checkpoints)
        position = client_state["data_position"]
        if rank == 0:
            print(f"finetune: resumed from {path} at step {engine.global_steps}", flush=True)
    else:
        deepcompile.load_hf_weights(engine, pretrained)  # every rank reads only its own slices
    engine.compile(backend=args.backend, regional=True)  # one graph for all identical decoder layers

    dataset = TokenRows(args.rows, args.seq, engine.module.config.vocab_size)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(dataset, batch_size=engine.config.train_micro_batch_size_per_gpu, sampler=sampler,
                        drop_last=True)

    start_step, start = engine.global_steps, time.perf_counter()
    for epoch, done, batch in batches_from(loader, sampler, position):
        if engine.global_steps >= total_steps:
            break
        batch = {k: v.to(device) for k, v in batch.items()}
        loss = engine(**batch).loss
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()  # the optimizer steps at the gradient-accumulation boundary only
        if boundary and (engine.global_steps % args.save_every == 0 or engine.global_steps == total_steps):
            path = engine.save_checkpoint(checkpoints, client_state={
                "data_position": {"epoch": epoch, "batches_done": done}})
            if rank == 0:
                print(f"finetune: saved checkpoint {path}", flush=True)

    engine.save_hf(os.path.join(args.out, "final"))  # rank 0 writes save_pretrained-style files
    if rank == 0:
        print(f"finetune: trained steps {start_step} -> {engine.global_steps} in {time.perf_counter() - start:.1f} s; "
              f"weights for from_pretrained in {os.path.join(args.out, 'final')}", flush=True)
    engine.destroy()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
