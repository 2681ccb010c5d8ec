"""Structure of the ZeRO-3 pass on small ATen graphs (no runtime needed: nothing executes)."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import deepcompile  # noqa: F401  (loads torch.ops.dc)
from deepcompile.passes.reduce import insert_reductions
from deepcompile.passes.zero3 import insert_gather_release

dc = torch.ops.dc


def _trace(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def _params(gm, count):
    return {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder") if i < count}


def _order(gm):
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def _ancestors(node):
    seen, stack = set(), [node]
    while stack:
        for a in stack.pop().all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    return seen


def test_gather_before_first_use_and_release_after_last_use():
    def f(w1, w2, x):
        h = torch.relu(x @ w1.t())
        return (h @ w2.t()).sum() + w1.sum()

    gm = _trace(f, torch.randn(5, 3), torch.randn(2, 5), torch.randn(4, 3))
    params = _params(gm, 2)
    insert_gather_release(gm, graph_id=7, params=params)
    order = _order(gm)
    for param, ds_id in params.items():
        (gather,) = [u for u in param.users]  # the placeholder now feeds only its gather
        assert gather.target is dc.allgather_param.default and gather.args[1:3] == (7, ds_id)
        (wait,) = list(gather.users)
        assert wait.target is dc.wait_allgather.default
        releases = [n for n in gm.graph.nodes if n.target is dc.release_param.default and n.args[2] == ds_id]
        # One release per reader that no other release depends on (w1: x @ w1.t() and w1.sum() are
        # independent), each counting the episode's releases.
        assert len(releases) == (2 if ds_id == 0 else 1) and all(r.args[3] == len(releases) for r in releases)
        readers = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is not dc.release_param.default
                   and any(a is wait or (isinstance(a, torch.fx.Node) and a.args and a.args[0] is wait) for a in n.args)]
        # Data dependencies, not just graph order, put every reader before some release.
        assert all(any(r in _ancestors(rel) for rel in releases) for r in readers)
        # Nothing reads the gathered value (or a view of it) after its release.
        assert order[gather] < min(order[r] for r in readers)


def test_cast_only_use_is_fused_into_the_gather():
    def f(w, x):
        return x.to(torch.bfloat16) @ w.to(torch.bfloat16).t()

    gm = _trace(f, torch.randn(5, 3), torch.randn(4, 3))
    params = _params(gm, 1)
    insert_gather_release(gm, graph_id=1, params=params)
    gathers = [n for n in gm.graph.nodes if n.target is dc.allgather_param.default]
    assert len(gathers) == 1 and gathers[0].kwargs["dtype"] == torch.bfloat16
    # The cast of the parameter is gone: the graph reads the narrow gather directly.
    (param,) = params
    assert not any(n.target is torch.ops.prims.convert_element_type.default and n.args[0] is param for n in gm.graph.nodes)


def test_backward_gradients_are_reduced_and_returned_as_none():
    def bw(w, g):
        return (g * 2, None, w * 3)

    gm = _trace(bw, torch.randn(3), torch.randn(3))
    reductions = insert_reductions(gm, graph_id=4, grad_slots={0: 11, 1: 12, 2: 13})
    assert [r.args[2] for r in reductions] == [11, 13]  # no reduction for the None gradient
    out = gm.graph.output_node().args[0]
    assert list(out) == [None, None, None]
    (end,) = [n for n in gm.graph.nodes if n.target is dc.end_backward.default]
    assert set(end.args[0]) == set(reductions) and end.args[1:] == (4, False)
    assert _order(gm)[end] > max(_order(gm)[r] for r in reductions)


class _RecordReductions(torch.fx.Interpreter):
    """Runs a pass output with the dc ops stubbed: records what each reduce_grad receives."""

    def __init__(self, gm):
        super().__init__(gm)
        self.reduced = {}

    def call_function(self, target, args, kwargs):
        if target is dc.reduce_grad.default:
            self.reduced[args[2]] = args[0]
            return args[0].new_empty((0,))
        if target is dc.end_backward.default:
            return None
        return super().call_function(target, args, kwargs)


def test_transposed_weight_gradients_reach_reduce_grad_contiguous():
    # A linear layer's weight gradient as AOT decomposes it: the transpose of a matrix product.
    def bw(x, g, v):
        return (torch.mm(x.t(), g).t(), torch.mm(x.t(), g), v.t())

    x, g, v = torch.randn(6, 4), torch.randn(6, 5), torch.randn(3, 2)
    gm = _trace(bw, x, g, v)
    insert_reductions(gm, graph_id=2, grad_slots={0: 1, 1: 2, 2: 3})
    reductions = {n.args[2]: n for n in gm.graph.nodes if n.target is dc.reduce_grad.default}
    product = reductions[1].args[0]
    assert product.target is torch.ops.aten.mm.default  # no transpose between product and reduction
    assert product.meta["val"].is_contiguous() and tuple(product.meta["val"].shape) == (5, 4)
    # A transpose of anything but a product is left alone (nothing to swap).
    assert reductions[3].args[0].target is not torch.ops.aten.mm.default
    # The replaced transpose and its product are gone; the other product stays.
    assert sum(n.target is torch.ops.aten.mm.default for n in gm.graph.nodes) == 2
    recorder = _RecordReductions(gm)
    recorder.run(x, g, v)
    torch.testing.assert_close(recorder.reduced[1], (x.t() @ g).t())
    assert recorder.reduced[1].is_contiguous()
    torch.testing.assert_close(recorder.reduced[2], x.t() @ g)
    torch.testing.assert_close(recorder.reduced[3], v.t())


def test_prefetch_groups_are_fused_launched_ahead_and_keep_dtypes():
    from deepcompile.passes.prefetch import apply_prefetch
    from deepcompile.scheduling.planner import plan_prefetch

    def f(w1, w2, w3, x):
        h = torch.relu(x @ w1.t())
        h = torch.relu(h @ w2.to(torch.bfloat16).float().t())
        return (h @ w3.t()).sum()

    gm = _trace(f, torch.randn(5, 3), torch.randn(5, 5), torch.randn(2, 5), torch.randn(4, 3))
    insert_gather_release(gm, graph_id=3, params=_params(gm, 3))
    # Caps of 25 elements: [w1 (15)], [w2 (25)], [w3 (10)] -- w1 + w2 would exceed the cap.
    assert [len(g.gathers) for g in plan_prefetch(gm, 25).groups] == [1, 1, 1]
    plan = plan_prefetch(gm, 40)
    assert [len(g.gathers) for g in plan.groups] == [2, 1]
    assert not plan.guided and all(g.ahead for g in plan.groups)  # no profile: the static plan
    apply_prefetch(gm, graph_id=3, plan=plan)
    order = _order(gm)
    prefetches = [n for n in gm.graph.nodes if n.target is dc.prefetch_params_fused.default]
    gathers = [n for n in gm.graph.nodes if n.target is dc.allgather_param.default]
    # Group 0 (w1, w2) launched at the head of the graph, group 1 (w3) at the start of group 0.
    assert [p.args[2] for p in prefetches] == [[0, 1], [2]]
    assert order[prefetches[0]] < order[prefetches[1]] < order[gathers[0]]
    # The fused-cast dtype of w2 is kept in the prefetch.
    assert prefetches[0].kwargs["dtypes"] == [torch.float32, torch.bfloat16]
    for p in prefetches:
        assert all(a.op == "placeholder" for a in p.args[1])


def _release_source(release):
    """The node a release is anchored on, past other releases chained on the same result."""
    node = release.args[0]
    while node.target is dc.release_param.default:
        node = node.args[0]
    return node


def test_runtime_ops_leave_pointwise_regions_whole():
    """Inductor fuses no generated kernel across a runtime op, so the pass keeps them at library
    calls: a parameter read inside a pointwise region (an RMSNorm weight) is gathered before the
    region starts and released on the product that consumes the region's result."""

    def f(w1, w_norm, w2, x):
        h = x @ w1.t() + x  # residual add
        n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True)) * w_norm
        return (n @ w2.t()).sum()

    gm = _trace(f, torch.randn(3, 3), torch.randn(3), torch.randn(2, 3), torch.randn(4, 3))
    params = _params(gm, 3)
    insert_gather_release(gm, graph_id=2, params=params)
    order = _order(gm)
    w1, w_norm, w2 = params
    (wait_norm,) = [n for n in gm.graph.nodes if n.target is dc.wait_allgather.default and n.args[2] == params[w_norm]]
    x = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    (residual,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.add.Tensor and x in n.all_input_nodes]
    assert order[wait_norm] < order[residual], "the norm weight's wait splits the region before it"
    releases = {n.args[2]: n for n in gm.graph.nodes if n.target is dc.release_param.default}
    norm_anchor = _release_source(releases[params[w_norm]])
    assert norm_anchor.target is torch.ops.aten.mm.default
    assert _release_source(releases[params[w2]]) is norm_anchor  # the product that reads the region
    # No pointwise node feeds a release (which would force it into memory and end the region).
    assert all(_release_source(r).target is torch.ops.aten.mm.default for r in releases.values())



def test_a_pointwise_reader_read_again_after_the_next_product_is_released_on_its_own_result():
    """An embedding lookup read by a norm before the first product and by a residual add after
    it: Inductor would recompute the lookup (reading the weight) inside the add's kernel, after a
    release anchored on the product (a segfault seen with PEFT LoRA on the CPU). The release takes
    the lookup's own result, which Inductor then stores; a lookup read only up to the product
    keeps the product as anchor."""

    def late_reader(w_emb, w1, ids):
        e = torch.nn.functional.embedding(ids, w_emb)
        n = e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True))
        return ((n @ w1.t()) + e).sum()

    def no_late_reader(w_emb, w1, ids):
        e = torch.nn.functional.embedding(ids, w_emb)
        n = e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True))
        return (n @ w1.t()).sum()

    for fn, anchored_on in ((late_reader, torch.ops.aten.embedding.default), (no_late_reader, torch.ops.aten.mm.default)):
        gm = _trace(fn, torch.randn(10, 4), torch.randn(4, 4), torch.randint(0, 10, (2, 3)))
        params = _params(gm, 2)
        insert_gather_release(gm, graph_id=1, params=params)
        w_emb = next(iter(params))
        (release,) = [n for n in gm.graph.nodes if n.target is dc.release_param.default and n.args[2] == params[w_emb]]
        assert _release_source(release).target is anchored_on, fn.__name__


def test_gathered_layout_reaches_views_and_exact_stride_ops():
    """The placeholder a parameter is traced as is expanded (stride 0); its gather is contiguous.
    Views of the gathered value, and the eager inputs recorded for an op that needs exact input
    strides (which Inductor copies its arguments into), must describe the contiguous tensor, else
    the op reads one element repeated (seen with transformers' grouped-mm expert kernel)."""
    import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback)

    grouped_mm = torch.ops.transformers.grouped_mm_fallback.default

    def f(w, x, offs):
        return grouped_mm(x, w.transpose(-2, -1), offs)

    placeholder = torch.full((1, 1, 1), float("nan")).expand(3, 6, 5)  # (experts, out, in)
    gm = _trace(f, placeholder, torch.randn(7, 5), torch.tensor([2, 5, 7], dtype=torch.int32))
    (call,) = [n for n in gm.graph.nodes if n.target is grouped_mm]
    traced_weight = call.args[1].meta["val"]
    assert traced_weight.stride() == (0, 0, 0)  # what the pass has to correct
    insert_gather_release(gm, graph_id=1, params=_params(gm, 1))
    (call,) = [n for n in gm.graph.nodes if n.target is grouped_mm]
    expected = torch.empty(3, 6, 5).transpose(-2, -1).stride()
    assert call.args[1].meta["val"].stride() == expected
    if "eager_input_vals" in call.meta:  # recorded for ops that need exact strides
        assert call.meta["eager_input_vals"][0][1].stride() == expected
