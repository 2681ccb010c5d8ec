"""Train a small Llama with deepcompile ZeRO-3 and check it against single-process training.

    torchrun --nproc-per-node 2 examples/train_llama.py [--steps 8] [--backend inductor|eager] [--cpu]

Runs on GPUs with NCCL, one per process, when the machine has at least as many GPUs as this node
runs processes; otherwise (no GPU, or one GPU for two processes) every process runs on the CPU
with gloo, so the command above works on a laptop and on a one-GPU box alike. Each rank trains on its slice
of every global batch; per step rank 0 prints the loss (mean over ranks), the step time and the
tokens/s over all ranks. At the end rank 0 retrains the same model on the whole batches in one
process and checks losses and final parameters against the distributed run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import deepcompile

VOCAB, SEQ = 256, 32


def training_device(force_cpu: bool = False) -> torch.device:
    """This process's GPU when every process of this node can have its own, else the CPU.

    Checked before the process group exists, so that the backend fits the device: NCCL needs one
    GPU per process, and two processes on one GPU would fail at the first collective."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if force_cpu or not torch.cuda.is_available() or torch.cuda.device_count() < local_world:
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def build_model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).to(device)


def global_batch(step: int, batch: int, device: torch.device) -> torch.Tensor:
    """Counting sequences from random starts: learnable, so the loss visibly falls."""
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, VOCAB, (batch, 1), generator=g)
    return ((starts + torch.arange(SEQ)) % VOCAB).to(device)


def optimizer_for(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-3)


def train_distributed(args, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(device)
    config = {
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 20_000, "stage3_param_persistence_threshold": 1_000},
        "train_micro_batch_size_per_gpu": args.batch // world,
        "gradient_clipping": 1.0,
    }
    if args.offload:
        # The Adam state lives in host memory between steps; the step streams it back a few
        # parameters at a time (sub_group_size), overlapping reloads, the step and write-backs.
        config["zero_optimization"].update(offload_optimizer={"device": "cpu", "pin_memory": True},
                                           sub_group_size=50_000)
    engine = deepcompile.initialize(model, optimizer_for(model), config)
    engine.compile(backend=args.backend)
    per_rank = args.batch // world
    losses = []
    for step in range(args.steps):
        tokens = global_batch(step, args.batch, device)[rank * per_rank : (rank + 1) * per_rank]
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        mean = mean.item() / world  # also waits for the step to finish
        elapsed = time.perf_counter() - start
        losses.append(mean)
        if rank == 0:
            print(f"step {step:3d}  loss {mean:.5f}  step time {elapsed * 1e3:8.1f} ms  "
                  f"tokens/s {args.batch * SEQ / elapsed:10.1f}", flush=True)
    state = engine.full_state_dict()  # on rank 0; {} elsewhere
    engine.destroy()
    return losses, state


def train_single_process(args, device):
    model = build_model(device)
    opt = optimizer_for(model)
    losses = []
    for step in range(args.steps):
        tokens = global_batch(step, args.batch, device)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--backend", default="inductor", choices=["inductor", "eager"])
    parser.add_argument("--rtol", type=float, default=None, help="default: 1e-4 (inductor) / 1e-5 (eager)")
    parser.add_argument("--offload", action="store_true", help="optimizer-state offload to host memory")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU with gloo even where there are GPUs")
    args = parser.parse_args()

    device = training_device(force_cpu=args.cpu)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if dist.get_rank() == 0:
        print(f"deepcompile ZeRO-3: {dist.get_world_size()} ranks on {device.type}, backend {args.backend}", flush=True)

    losses, state = train_distributed(args, device)
    ok = True
    if dist.get_rank() == 0:
        ref_losses, ref_state = train_single_process(args, device)
        rtol = args.rtol if args.rtol is not None else (1e-4 if args.backend == "inductor" else 1e-5)
        loss_err = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
        param_err = max(((state[k].float() - v.float()).abs().max() / v.float().abs().max().clamp_min(1e-12)).item()
                        for k, v in ref_state.items() if v.is_floating_point())
        ok = loss_err <= rtol and param_err <= 10 * rtol
        print(f"single-process check: max loss rel. error {loss_err:.2e}, max param rel. error {param_err:.2e} "
              f"-> {'OK' if ok else 'MISMATCH'}", flush=True)
    flag = torch.tensor([int(ok)], device=device)
    dist.broadcast(flag, src=0)
    dist.destroy_process_group()
    return 0 if flag.item() else 1


if __name__ == "__main__":
    sys.exit(main())
