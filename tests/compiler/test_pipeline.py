"""The backend's passes as data (deepcompile/compiler/pipeline.py): their order, their contracts,
and that the backend and re-planning run that one list."""

from __future__ import annotations

import types

import pytest
import torch

from deepcompile.compiler import pipeline
from deepcompile.compiler.pipeline import PIPELINE, HalfContext, PassEntry, Pipeline, PipelineError, Stage


def test_the_order_of_the_passes():
    assert PIPELINE.names == [
        "reduce_gradients", "gather_release", "check_placeholders", "saved_values", "offload_activations",
        "reload_activations", "free_activations", "prefetch", "place_reloads", "to_slot_ops"]
    stages = {e.name: e.stage for e in PIPELINE.entries}
    # Re-planning re-runs exactly the plan's slice (compiler/replan.py).
    assert [n for n, s in stages.items() if s is Stage.PLAN] == ["prefetch", "place_reloads"]
    assert [n for n, s in stages.items() if s is Stage.LOWER] == ["to_slot_ops"]


def test_every_requirement_is_provided_earlier():
    provided = set()
    for entry in PIPELINE.entries:
        assert entry.requires <= provided, entry.name
        provided |= entry.provides


def _noop(ctx):
    pass


def test_a_requirement_provided_later_names_both_passes():
    entries = [PassEntry("needs", _noop, Stage.STRUCTURE, requires=frozenset({"x"})),
               PassEntry("gives", _noop, Stage.STRUCTURE, provides=frozenset({"x"}))]
    with pytest.raises(PipelineError, match=r"pass 'needs' requires 'x', which pass 'gives' provides only after it"):
        Pipeline(entries)


def test_a_requirement_nobody_provides_is_refused():
    with pytest.raises(PipelineError, match=r"pass 'needs' requires 'x', which no pass"):
        Pipeline([PassEntry("needs", _noop, Stage.STRUCTURE, requires=frozenset({"x"}))])


def test_moving_a_real_pass_ahead_of_its_provider_fails():
    entries = list(PIPELINE.entries)
    prefetch = next(e for e in entries if e.name == "prefetch")
    entries.remove(prefetch)
    entries.insert(0, prefetch.__class__(**{**prefetch.__dict__, "stage": Stage.STRUCTURE}))
    with pytest.raises(PipelineError, match="'prefetch' requires 'gathers'.*'gather_release'"):
        Pipeline(entries)


def test_stages_run_in_order_and_names_are_unique():
    with pytest.raises(PipelineError, match="stages run in order"):
        Pipeline([PassEntry("late", _noop, Stage.PLAN), PassEntry("early", _noop, Stage.STRUCTURE)])
    with pytest.raises(PipelineError, match="appears twice"):
        Pipeline([PassEntry("a", _noop, Stage.STRUCTURE), PassEntry("a", _noop, Stage.STRUCTURE)])


def _record():
    return types.SimpleNamespace(graph_id=1, param_slots={}, slot_ids=[], fw_param_names={}, saved={},
                                 offload_sites={}, reduced_ids=[], num_fwd_outputs=None)


def _ctx(phase, zero_stage, activations=None):
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    return HalfContext(gm, phase, _record(), zero_stage, activations=activations)


@pytest.mark.parametrize("phase,zero_stage,activations,expected", [
    ("forward", 1, None, []),
    ("backward", 2, None, ["reduce_gradients"]),
    ("forward", 3, None, ["gather_release"]),
    ("backward", 3, None, ["reduce_gradients", "gather_release"]),
    ("forward", 1, types.SimpleNamespace(offload=False, free=True), ["saved_values"]),
    ("backward", 1, types.SimpleNamespace(offload=False, free=True), ["reduce_gradients", "free_activations"]),
])
def test_which_structure_passes_apply(phase, zero_stage, activations, expected, monkeypatch):
    ran = []
    entries = [e.__class__(**{**e.__dict__, "run": lambda ctx, name=e.name: ran.append(name)})
               for e in PIPELINE.entries]
    ctx = Pipeline(entries).run(_ctx(phase, zero_stage, activations), [Stage.STRUCTURE])
    assert ran == expected == ctx.applied


def test_the_backend_and_replan_run_the_pipeline():
    """Neither hand-writes the sequence again: they call the passes only through PIPELINE."""
    import inspect

    from deepcompile.compiler import backend, replan

    for module in (backend, replan):
        source = inspect.getsource(module)
        assert "PIPELINE.run(" in source
        for name in ("apply_prefetch", "place_reloads", "insert_gather_release", "insert_reductions",
                     "insert_frees", "insert_offloads", "insert_reloads", "to_slot_ops"):
            assert f"{name}(" not in source, f"{module.__name__} calls {name} outside the pipeline"
    assert pipeline.PIPELINE is backend.PIPELINE
