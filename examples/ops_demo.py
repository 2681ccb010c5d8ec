"""Two-process demo of the op library on CPU: gather, release and reduce through torch.ops.dc.

    torchrun --nproc-per-node 2 examples/ops_demo.py

Each rank holds one shard of a parameter, gathers it (in bf16, cast fused into the gather),
releases it (the padded storage is freed), then reduces a rank-specific gradient into its
partition and checks the result against torch.distributed.
"""

import torch
import torch.distributed as dist

from deepcompile import runtime

GRAPH, PARAM = 1, 0


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    runtime.init(config=runtime.RuntimeConfig(reduce_bucket_size=1024))

    full = torch.arange(10, dtype=torch.float32).reshape(2, 5)  # 10 elements: uneven for world 3
    ppr = -(-full.numel() // world)
    padded = torch.zeros(ppr * world)
    padded[: full.numel()] = full.flatten()
    shard = padded[rank * ppr : (rank + 1) * ppr].clone()
    grad_partition = torch.empty(ppr)
    runtime.register_z3_param(PARAM, full.shape, shard, grad_partition)
    runtime.register_graph(GRAPH, [PARAM], stage=3)

    gathered = torch.ops.dc.allgather_param(shard, GRAPH, PARAM, torch.bfloat16)
    gathered = torch.ops.dc.wait_allgather(gathered, GRAPH, PARAM)
    assert torch.equal(gathered, full.bfloat16()), "gather returned the wrong values"
    torch.ops.dc.release_param(gathered, GRAPH, PARAM, 1)
    print(f"[rank {rank}] gathered {tuple(gathered.shape)} {gathered.dtype}; "
          f"after release its storage holds {gathered.untyped_storage().nbytes()} bytes")

    runtime.start_backward(update=True)
    grad = torch.full_like(full, float(rank + 1))
    torch.ops.dc.reduce_grad(grad, GRAPH, PARAM)
    torch.ops.dc.end_backward([], GRAPH, True)

    expected = grad.clone()
    dist.all_reduce(expected)
    expected = torch.cat([expected.flatten() / world, torch.zeros(ppr * world - full.numel())])
    assert torch.allclose(grad_partition, expected[rank * ppr : (rank + 1) * ppr])
    print(f"[rank {rank}] reduced gradient partition {grad_partition.tolist()} matches torch.distributed")

    runtime.cleanup()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
