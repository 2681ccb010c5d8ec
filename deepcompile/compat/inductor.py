"""Inductor: the inner compiler, its decompositions, its joint-graph passes, and the lowerings
that keep it from recycling buffers the runtime owns."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Dict, Iterable, List, Sequence, Tuple

import torch
from torch.fx import GraphModule

from deepcompile.compat.fx import tree_leaves


def inductor_decompositions() -> Dict[Any, Callable]:
    """The decomposition table Inductor itself would hand aot_autograd.

    Relies on ``torch._inductor.decomposition.select_decomp_table`` (it reads Inductor's config,
    so it is asked at each compile rather than cached).
    """
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def inductor_compile(gm: GraphModule, example_inputs: Sequence[Any], is_backward: bool,
                     unread_inputs: Sequence[int] = ()) -> Callable:
    """Compile one graph half with Inductor, as its own aot_autograd callbacks do.

    ``unread_inputs``: positions of inputs the generated code never reads (ZeRO-3 placeholders,
    handed only to the runtime's gathers). They are passed as Inductor's static inputs, which
    exempts them from its per-call alignment check of GPU inputs: that check reads
    ``data_ptr()``, which a placeholder's storage refuses.

    Must run inside aot_autograd's compiler callbacks (they set up the fake-tensor and tracing
    context Inductor expects). Relies on ``torch._inductor.compile_fx.compile_fx_inner`` and its
    ``static_input_idxs``; its result is boxed (takes one argument list, which the generated
    code clears).
    """
    from torch._inductor.compile_fx import compile_fx_inner

    return compile_fx_inner(gm, example_inputs, is_backward=is_backward, static_input_idxs=list(unread_inputs))



def inductor_compiler_for_later(example_inputs: Sequence[Any], is_backward: bool,
                                unread_inputs: Callable[[GraphModule], Sequence[int]] = lambda gm: ()
                                ) -> Callable[[GraphModule], Callable]:
    """A function that compiles a graph half with Inductor *after* aot_autograd's compiler
    callback has returned: a deferred first compile, or a re-planned graph (same inputs and
    outputs, other side-effecting ops) compiled for the same ``example_inputs``.

    Must itself be called inside the callback: it keeps the tracing and compile contexts that
    are active there and re-enters them at each later compile, as aot_autograd's own lazy
    backward compile does. The forward output strides a later compile reports go to a scratch
    list, so what aot_autograd recorded from the first compile stays as it was.

    Relies on ``torch._guards.TracingContext`` / ``CompileContext`` (``try_get``, ``tracing``,
    ``compile_context``, ``report_output_strides``) and ``compile_fx_inner``.
    """
    from torch._guards import CompileContext, TracingContext, compile_context, tracing

    saved_tracing, saved_compile = TracingContext.try_get(), CompileContext.try_get()
    inputs = list(example_inputs)

    def compile_later(gm: GraphModule) -> Callable:
        with tracing(saved_tracing), compile_context(saved_compile), TracingContext.report_output_strides():
            return inductor_compile(gm, inputs, is_backward=is_backward, unread_inputs=unread_inputs(gm))

    return compile_later


def compiled_output_strides(compiled: Any) -> Any:
    """The output strides Inductor chose for a compiled graph half (None if unknown).

    A forward's saved activations may get other strides than eager ones, and its backward is
    compiled for those: a re-planned forward may replace the first only if they agree. Relies
    on ``CompiledFxGraph.output_strides``.
    """
    strides = getattr(compiled, "output_strides", None)
    return list(strides) if strides is not None else None


_INDUCTOR_PROTECTED = False


def protect_runtime_buffers_in_inductor(protected: Iterable[Tuple[Any, bool, bool]]) -> None:
    """Stop Inductor from recycling buffers the runtime manages behind its back.

    Inductor's wrapper reuses a dead buffer's storage for a later output of the same size. That is
    wrong for (a) gathered parameters, whose storage ``release_param`` frees (or, for persistent
    parameters, keeps for the next step), and (b) gradients handed to ``reduce_grad``, which the
    copy lane may still read after the op returned. Each op gets Inductor's standard fallback
    lowering, plus the affected buffer names in ``V.graph.never_reuse_buffers``. ``protected``:
    (op overload, protect its inputs, protect its outputs), as ``deepcompile/ops.py`` lists them
    (compat knows torch, not which ops the package defines). Registered once per process.

    Relies on ``torch._inductor.lowering.register_lowering`` / ``fallback_handler`` and
    ``GraphLowering.never_reuse_buffers``.
    """
    global _INDUCTOR_PROTECTED
    if _INDUCTOR_PROTECTED:
        return
    from torch._inductor import ir
    from torch._inductor.lowering import fallback_handler, register_lowering
    from torch._inductor.virtualized import V

    def names(tree) -> List[str]:
        out = []
        for leaf in tree_leaves(tree):
            if isinstance(leaf, ir.IRNode):
                try:
                    out.append(leaf.get_name())
                except (AttributeError, NotImplementedError):
                    pass  # nameless IR (constants, views of inputs): no buffer to protect
        return out

    def lower(op, protect_inputs: bool, protect_outputs: bool) -> None:
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

    for op, protect_inputs, protect_outputs in protected:
        lower(op, protect_inputs=protect_inputs, protect_outputs=protect_outputs)
    _INDUCTOR_PROTECTED = True


def inductor_joint_graph_passes(joint: GraphModule, joint_inputs) -> GraphModule:
    """Run Inductor's joint-graph passes on a joint forward/backward graph, as its own partition
    function does before the min-cut partitioner.

    The backend partitions the joint graph itself (ZeRO-3 marks parameter views for recompute
    first), so without this it would skip the passes Inductor runs there: no-op removal and the
    pattern rewrites that, among others, let the loss gradient be produced in bf16 instead of a
    materialised fp32 copy of the logits (docs/design/measured.md).

    Relies on ``torch._inductor.compile_fx._recursive_joint_graph_passes``. Its signature differs
    between versions (2.12 takes ``input_device`` and returns the graph module; older ones rewrite
    in place and return None), so the call adapts to the parameters it finds.
    """
    from torch._inductor import compile_fx

    run = compile_fx._recursive_joint_graph_passes
    accepted = inspect.signature(run).parameters
    kwargs = {}
    if "skip_invoke_subgraph" in accepted:
        kwargs["skip_invoke_subgraph"] = True  # aot_autograd partitions those subgraphs itself
    if "input_device" in accepted and hasattr(compile_fx, "get_inputs_devices"):
        kwargs["input_device"] = compile_fx.get_inputs_devices(joint_inputs, joint)[0]
    device_context = getattr(compile_fx, "get_cuda_device_context", lambda gm: contextlib.nullcontext())
    with device_context(joint), _fake_mode_of(joint_inputs):
        out = run(joint, **kwargs)
    return joint if out is None else out


def _fake_mode_of(joint_inputs):
    """Inductor's virtualized fake mode, set to the joint inputs' own while its joint passes run.

    Inductor's own partition function runs inside ``V.set_fake_mode`` (compile_fx sets it around
    aot_autograd); the backend calls aot_autograd itself, outside it. Passes that create values
    read it: the random-op rewrite (``replace_random_passes``: dropout, ``rand_like``,
    ``bernoulli``) builds its seed tensor under ``V.fake_mode`` and failed without one. Relies on
    ``torch._inductor.virtualized`` (``V``, ``NullHandler``) and ``torch._guards.detect_fake_mode``."""
    from torch._guards import detect_fake_mode
    from torch._inductor import virtualized

    fake_mode = detect_fake_mode(joint_inputs)
    unset = getattr(virtualized, "NullHandler", None)  # what V holds while nothing is set
    if fake_mode is None or (unset is not None and not isinstance(virtualized.V.fake_mode, unset)):
        return contextlib.nullcontext()  # none to set, or already set by the caller
    return virtualized.V.set_fake_mode(fake_mode)
