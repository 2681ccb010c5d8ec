"""Everything that depends on the torch version or on torch internals lives here.

Supported: torch 2.11 (GPU machine) and 2.12 (CI). Each helper states what it relies on; the
tests in tests/test_compat.py fail loudly if a torch upgrade removes it.
"""

from __future__ import annotations

import torch

TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


def mark_ops_side_effectful() -> None:
    """Keep our output-less / result-unused ops alive through FX and Inductor dead-code removal.

    Uses the public ``torch.fx.node.has_side_effect`` registry, which FX's ``is_impure`` and
    Inductor's ``FallbackKernel.has_side_effects`` (through ``torch._library.utils.is_impure``)
    consult. Unlike DeepSpeed we do not switch off Inductor's dead-node elimination globally.
    """
    from torch.fx.node import has_side_effect

    dc = torch.ops.dc
    for op in (
        dc.end_backward.default,
        dc.reduce_grad.default,
        dc.release_param.default,
        dc.prefetch_params_fused.default,
        dc.wait_allgather.default,
    ):
        has_side_effect(op)


def protect_runtime_buffers_in_inductor() -> None:
    """Stop Inductor from recycling buffers the runtime manages behind its back.

    Inductor's wrapper reuses a dead buffer's storage for a later output of the same size. That is
    wrong for (a) gathered parameters, whose storage ``release_param`` frees (or, for persistent
    parameters, keeps for the next step), and (b) gradients handed to ``reduce_grad``, which the
    copy lane may still read after the op returned. Each op gets Inductor's standard fallback
    lowering, plus the affected buffer names in ``V.graph.never_reuse_buffers``.

    Relies on ``torch._inductor.lowering.register_lowering`` / ``fallback_handler`` and
    ``GraphLowering.never_reuse_buffers`` (present in torch 2.11 and 2.12).
    """
    global _INDUCTOR_PROTECTED
    if _INDUCTOR_PROTECTED:
        return
    from torch._inductor import ir
    from torch._inductor.lowering import fallback_handler, register_lowering
    from torch._inductor.virtualized import V
    from torch.utils import _pytree as pytree

    def names(tree):
        out = []
        for leaf in pytree.tree_leaves(tree):
            if isinstance(leaf, ir.IRNode):
                try:
                    out.append(leaf.get_name())
                except (AttributeError, NotImplementedError):
                    pass  # nameless IR (constants, views of inputs): no buffer to protect
        return out

    def lower(op, protect_inputs: bool, protect_outputs: bool):
        fallback = fallback_handler(op, add_to_fallback_set=True)

        def lowering(*args, **kwargs):
            if protect_inputs:
                for arg in (*args, *kwargs.values()):
                    if isinstance(arg, ir.IRNode):
                        arg.realize()
                V.graph.never_reuse_buffers.update(names((args, kwargs)))
            result = fallback(*args, **kwargs)
            if protect_outputs:
                V.graph.never_reuse_buffers.update(names(result))
            return result

        register_lowering(op, type_promotion_kind=None)(lowering)

    dc = torch.ops.dc
    lower(dc.allgather_param.default, protect_inputs=False, protect_outputs=True)
    lower(dc.wait_allgather.default, protect_inputs=True, protect_outputs=True)
    lower(dc.reduce_grad.default, protect_inputs=True, protect_outputs=True)
    _INDUCTOR_PROTECTED = True


_INDUCTOR_PROTECTED = False


def inductor_joint_graph_passes(joint: "torch.fx.GraphModule", joint_inputs) -> "torch.fx.GraphModule":
    """Run Inductor's joint-graph passes on a joint forward/backward graph, as its own partition
    function does before the min-cut partitioner.

    The backend partitions the joint graph itself (ZeRO-3 marks parameter views for recompute
    first), so without this it would skip the passes Inductor runs there: no-op removal and the
    pattern rewrites that, among others, let the loss gradient be produced in bf16 instead of a
    materialised fp32 copy of the logits (1 GiB on a 32k-vocabulary Llama at 8k tokens per rank).

    Relies on ``torch._inductor.compile_fx._recursive_joint_graph_passes``. Its signature differs
    between versions (2.12 takes ``input_device`` and returns the graph module; older ones rewrite
    in place and return None), so the call adapts to the parameters it finds.
    """
    import contextlib
    import inspect

    from torch._inductor import compile_fx

    run = compile_fx._recursive_joint_graph_passes
    accepted = inspect.signature(run).parameters
    kwargs = {}
    if "skip_invoke_subgraph" in accepted:
        kwargs["skip_invoke_subgraph"] = True  # aot_autograd partitions those subgraphs itself
    if "input_device" in accepted and hasattr(compile_fx, "get_inputs_devices"):
        kwargs["input_device"] = compile_fx.get_inputs_devices(joint_inputs, joint)[0]
    device_context = getattr(compile_fx, "get_cuda_device_context", lambda gm: contextlib.nullcontext())
    with device_context(joint):
        out = run(joint, **kwargs)
    return joint if out is None else out
