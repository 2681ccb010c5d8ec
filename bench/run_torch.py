"""The plain PyTorch family of ``bench/train_bench.py``'s rows, the peers: FSDP2 + compile (with or
without CPU offload) and DDP + compile. How each keeps its weights: train_bench.py's docstring.
"""

from __future__ import annotations

from typing import Optional

import torch

from train_core import Context, Runner, build_meta_model, build_model, init_local_shards, make_optimizer


def torch_training_runner(compiled, optimizer, autocast_device: Optional[str] = None) -> Runner:
    """The plain PyTorch step shared by the peers (FSDP2, DDP); bf16 autocast when asked."""

    def step(tokens: torch.Tensor) -> torch.Tensor:
        with torch.autocast(autocast_device or "cpu", dtype=torch.bfloat16, enabled=autocast_device is not None):
            loss = compiled(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return Runner(step)


def fsdp2_runner(ctx: Context, cpu_offload: bool = False) -> Runner:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    meta = ctx.args.init == "meta"
    # fp32 shards are the master weights
    model = build_meta_model(ctx, torch.float32) if meta else build_model(ctx, torch.float32)
    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    shard = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    if cpu_offload:  # parameters, gradients and the optimizer step on the host, pinned for the copies
        # (on a CPU smoke run there is nothing to pin for: the same code path, unpinned)
        shard["offload_policy"] = CPUOffloadPolicy(pin_memory=ctx.is_cuda)
    for layer in model.model.layers:
        fully_shard(layer, **shard)
    fully_shard(model, **shard)  # root: embeddings, final norm, LM head
    if meta:
        # The usual FSDP2 recipe: shards get storage (on the host when offloaded), then values.
        model.to_empty(device="cpu" if cpu_offload else ctx.device)
        torch.manual_seed(ctx.args.seed)
        init_local_shards(model, model._init_weights)
        if cpu_offload:  # FSDP2 moves parameters only: buffers (rotary inv_freq) go to the device
            for module in model.modules():
                for name, b in module._buffers.items():
                    if b is not None:
                        module._buffers[name] = b.to(ctx.device)
    optimizer = make_optimizer(ctx, model.parameters())  # DTensor shards (on the host with offload)
    return torch_training_runner(torch.compile(model, backend=ctx.backend), optimizer)


def ddp_runner(ctx: Context) -> Runner:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build_model(ctx, torch.float32)  # fp32 weights + autocast: see the module docstring
    ddp = DDP(model, device_ids=[ctx.device.index] if ctx.is_cuda else None)
    optimizer = make_optimizer(ctx, ddp.parameters())
    return torch_training_runner(torch.compile(ddp, backend=ctx.backend), optimizer,
                                 autocast_device=ctx.device.type)



def runner(ctx: Context, peer: str, cpu_offload: bool = False) -> Runner:
    """A peer row of the table: ``peer`` is "fsdp2" (``cpu_offload`` adds CPU offload) or "ddp"."""
    if peer == "fsdp2":
        return fsdp2_runner(ctx, cpu_offload=cpu_offload)
    if peer == "ddp" and not cpu_offload:
        return ddp_runner(ctx)
    raise ValueError(f"unknown torch peer {peer!r} (cpu_offload={cpu_offload})")
