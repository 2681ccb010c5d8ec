"""The import-time probes clients make of DeepSpeed's optional ops (issue 50, item 1): the served
``deepspeed`` answers as a DeepSpeed whose C++/CUDA ops are not built.

transformers' DeepSpeed tests decide whether to run their NVMe cases with
``from deepspeed.ops.aio import AsyncIOBuilder`` and
``deepspeed.ops.__compatible_ops__[AsyncIOBuilder.NAME]``; scripts and setup checks call
``AsyncIOBuilder().is_compatible()``, ``CPUAdamBuilder().is_compatible()``, ... from
``deepspeed.ops.op_builder`` before using an op, and ``load()`` it only when compatible.

``serve_as_deepspeed()`` rewrites ``sys.modules`` for the life of a process, so the probes run in
one served child process (this file's ``_probe_*`` functions, each caught on its own) and each test
reads its probe's outcome.
"""

from __future__ import annotations


import pytest

from _harness import served_probes


# DeepSpeed's builder classes and the op NAME each one has (its key in __compatible_ops__).
_BUILDERS = {"AsyncIOBuilder": "async_io", "CPUAdamBuilder": "cpu_adam", "CPUAdagradBuilder": "cpu_adagrad",
             "CPULionBuilder": "cpu_lion", "FusedAdamBuilder": "fused_adam", "FusedLambBuilder": "fused_lamb",
             "FusedLionBuilder": "fused_lion", "GDSBuilder": "gds", "TransformerBuilder": "transformer",
             "InferenceBuilder": "transformer_inference", "QuantizerBuilder": "quantizer",
             "SparseAttnBuilder": "sparse_attn", "EvoformerAttnBuilder": "evoformer_attn", "UtilsBuilder": "utils",
             "DeepCompileBuilder": "dc"}

# ---- probes: run in the served child process ------------------------------------------------


def _probe_transformers_require_deepspeed_aio():
    # transformers' tests/deepspeed/test_deepspeed.py, require_deepspeed_aio, on the served package
    from transformers.integrations.deepspeed import is_deepspeed_available

    assert is_deepspeed_available()
    import deepspeed
    from deepspeed.ops.aio import AsyncIOBuilder

    assert AsyncIOBuilder.NAME == "async_io"
    assert deepspeed.ops.__compatible_ops__[AsyncIOBuilder.NAME] is False  # the NVMe tests skip
    assert AsyncIOBuilder().is_compatible() is False
    assert AsyncIOBuilder().is_compatible(True) is False  # verbose, positionally (DeepSpeed's scripts)


def _probe_op_builder_names_import_and_report_not_compatible():
    import deepspeed
    from deepspeed.ops import op_builder
    from deepspeed.ops.aio import AsyncIOBuilder
    from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder, OpBuilder

    assert op_builder.AsyncIOBuilder is AsyncIOBuilder
    assert deepspeed.ops.op_builder.CPUAdamBuilder is CPUAdamBuilder  # attribute access, as in setup checks
    for class_name, op_name in _BUILDERS.items():
        cls = getattr(op_builder, class_name)
        builder = cls()
        assert isinstance(builder, OpBuilder), class_name
        assert cls.NAME == builder.name == op_name, class_name
        assert cls.BUILD_VAR.startswith("DS_BUILD_"), class_name
        assert builder.is_compatible() is False and builder.is_compatible(verbose=False) is False, class_name
    assert FusedAdamBuilder().is_compatible(verbose=True) is False
    try:  # a name DeepSpeed has no builder for fails to import, as there
        from deepspeed.ops.op_builder import NoSuchOpBuilder  # noqa: F401
    except ImportError:
        pass
    else:
        raise AssertionError("an unknown builder name imported")


def _probe_compatible_ops_answers_every_op_false():
    import deepspeed

    table = deepspeed.ops.__compatible_ops__
    assert isinstance(table, dict)
    assert set(_BUILDERS.values()) <= set(table)
    assert "deepspeed_not_implemented" in table  # the entry DeepSpeed adds
    assert not any(table.values()), {k: v for k, v in table.items() if v}


def _probe_load_raises_naming_the_op():
    from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder

    for cls, op_name, words in ((CPUAdamBuilder, "cpu_adam", "DeepSpeedCPUAdam"),
                                (AsyncIOBuilder, "async_io", "NVMe offload is not implemented")):
        for load in (cls().load, cls().jit_load):
            try:
                load()
            except RuntimeError as e:  # DeepSpeed's error for an op that cannot be loaded is a RuntimeError
                assert f"deepcompile does not implement DeepSpeed's {op_name} op" in str(e), e
                assert words in str(e), e
            else:
                raise AssertionError(f"{cls.__name__}.{load.__name__}() returned")


_PROBES = [name for name in list(globals()) if name.startswith("_probe_")]


# ---- tests: in pytest's process ----------------------------------------------------------------

@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ds_probes") / "outcomes.json")
    env = {"CUDA_VISIBLE_DEVICES": ""}
    return served_probes.run_in_served_child(__file__, "transformers_ds_probes", out, env, timeout=300)


@pytest.mark.parametrize("probe", _PROBES)
def test_probe(outcomes, probe):
    served_probes.check(outcomes, probe)
