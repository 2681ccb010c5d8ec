"""What a run shows without any logging setup (deepcompile/logging_setup.py, progress.py).

Two gloo ranks train a small ZeRO-3 model, compiled, through the profiled step and the schedule
switch, and save a checkpoint, in a process where nothing configured ``logging``: rank 0's stderr
has the step lines, the first compile, "profiling for the schedule", the switch line and the
checkpoint lines; rank 1's has none of them. ``DEEPCOMPILE_LOG_LEVEL=WARNING`` quiets rank 0, and
a program that configures logging itself gets each line once, through its own handler.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import threading

import pytest
import torch

from _harness.multiproc import run_distributed
from _harness.parity_cases import GLOBAL_BATCH, batch, build_model, make_optimizer

EXPECTED_ON_RANK0 = [
    # What runs, once (run_summary.py): at the first forward, after any change of compile arguments.
    "[deepcompile] deepcompile engine: ZeRO-3 over ",
    "[deepcompile] first compile: tracing and compiling the forward ...",
    "[deepcompile] step 0: profiling for the schedule",
    "[deepcompile] schedule switch at step 1",
    "[deepcompile] step 1: lr ",
    "[deepcompile] step 3: lr ",
    "[deepcompile] saving checkpoint into ",
    "[deepcompile] saved checkpoint ",
]


def _no_logging_configured():
    """A worker process may have served other tests: start from a program that configured nothing."""
    from deepcompile import logging_setup

    logging_setup.remove_handler()
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    logging.getLogger("deepcompile").setLevel(logging.NOTSET)


def _train(ctx, steps, ckpt=None):
    import deepcompile

    torch._dynamo.reset()
    model = build_model("mlp")
    cfg = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "steps_per_print": 1,
           "compile": {"warmup_steps": 1, "memory_budget_bytes": 1 << 30}}
    engine = deepcompile.initialize(model, make_optimizer(model.parameters()), cfg)
    engine.compile(backend="eager")
    n = GLOBAL_BATCH // ctx.world_size
    for step in range(steps):
        x, y = batch("mlp", step)
        engine.backward(engine(x[ctx.rank * n:(ctx.rank + 1) * n], y[ctx.rank * n:(ctx.rank + 1) * n]))
        engine.step()
    if ckpt is not None:
        engine.save_checkpoint(ckpt)
    report = engine.schedule_report()
    engine.destroy()
    return report


def _body(ctx, ckpt):
    _no_logging_configured()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            report = _train(ctx, 3, ckpt)
    finally:
        text = err.getvalue()
    lines = text.splitlines()
    for wanted in EXPECTED_ON_RANK0:
        seen = any(line.startswith(wanted) for line in lines)
        if ctx.rank == 0:
            assert seen, f"rank 0 did not print {wanted!r}; its stderr:\n{text}"
        else:
            assert not seen, f"rank {ctx.rank} printed {wanted!r}; its stderr:\n{text}"
    if ctx.rank == 0:
        (summary,) = [line for line in lines if "deepcompile engine:" in line]  # once
        assert summary.endswith("compiled (eager, whole model); prefetch + selective_gather from step 1"), summary
        switch = next(line for line in lines if "schedule switch at step 1" in line)
        for part in ("prefetch group(s)", "kept gathered", "offloaded: nothing", "predicted peak", "budget"):
            assert part in switch, f"{part!r} missing from the switch line: {switch}"
        assert "1.00 GiB budget" in switch, switch

    # The report: still a dict, and text for reading.
    assert isinstance(report, dict) and report["step"] == 1 and report["graphs"]
    as_text = report.to_text()
    assert as_text == str(report)
    assert as_text.startswith("deepcompile schedule at optimizer step 1: step 1: prefetch, selective_gather")
    assert "persistent:" in as_text and "prefetch" in as_text


def _quiet_body(ctx):
    _no_logging_configured()
    err = io.StringIO()
    os.environ["DEEPCOMPILE_LOG_LEVEL"] = "WARNING"
    try:
        with contextlib.redirect_stderr(err):
            _train(ctx, 2)
    finally:
        del os.environ["DEEPCOMPILE_LOG_LEVEL"]
    assert "[deepcompile]" not in err.getvalue(), err.getvalue()


def _configured_body(ctx):
    """The program configures logging itself, after an engine already added the default handler:
    each line reaches the program's handler once and nothing goes to stderr."""
    _no_logging_configured()
    err, mine = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err):
        _train(ctx, 1)  # installs the default handler (rank 0 prints to err)
        err.truncate(0)
        err.seek(0)
        handler = logging.StreamHandler(mine)
        logging.getLogger().addHandler(handler)
        logging.getLogger().setLevel(logging.INFO)
        try:
            _train(ctx, 2)
        finally:
            logging.getLogger().removeHandler(handler)
            logging.getLogger().setLevel(logging.WARNING)
    assert "[deepcompile]" not in err.getvalue(), err.getvalue()
    if ctx.rank == 0:
        step_lines = [line for line in mine.getvalue().splitlines() if line.startswith("step 2: lr ")]
        assert len(step_lines) == 1, mine.getvalue()


@pytest.mark.world_size(2)
def test_rank0_prints_the_run_without_logging_setup(tmp_path):
    run_distributed(_body, 2, args=(str(tmp_path / "ckpt"),), timeout=300)


@pytest.mark.world_size(2)
def test_log_level_env_quiets_and_user_logging_wins():
    run_distributed(_quiet_body, 2, timeout=300)
    run_distributed(_configured_body, 2, timeout=300)


def test_heartbeat_while_a_long_operation_runs(caplog):
    from deepcompile import progress

    seen = threading.Event()

    class Watch(logging.Handler):
        def emit(self, record):
            if "still running after" in record.getMessage():
                seen.set()

    watch = Watch()
    logger = logging.getLogger("deepcompile")
    logger.addHandler(watch)
    try:
        with caplog.at_level(logging.INFO, logger="deepcompile"):
            with progress.long_operation("exporting", show=True, every_s=0.01) as shown:
                # Ends once the heartbeat has spoken (bounded, so a broken heartbeat fails).
                assert seen.wait(60), "no heartbeat line while the operation ran"
                shown["done"] = "exported"
            with progress.long_operation("hidden", show=False):
                pass
    finally:
        logger.removeHandler(watch)
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "exporting ..."
    assert any(m.startswith("exporting: still running after") for m in messages)
    assert messages[-1].startswith("exported in ")
    assert not any("hidden" in m for m in messages)


def test_log_level_env_is_checked(monkeypatch):
    from deepcompile import logging_setup

    monkeypatch.setenv("DEEPCOMPILE_LOG_LEVEL", "debug")
    assert logging_setup.requested_level(0) == logging.DEBUG
    assert logging_setup.requested_level(1) == logging.WARNING
    monkeypatch.setenv("DEEPCOMPILE_LOG_LEVEL", "loud")
    with pytest.raises(ValueError, match="DEEPCOMPILE_LOG_LEVEL='loud': expected one of DEBUG, INFO"):
        logging_setup.requested_level(0)


def test_show_progress_leaves_the_programs_configuration_alone():
    from deepcompile import logging_setup

    root, logger = logging.getLogger(), logging.getLogger("deepcompile")
    saved = (list(root.handlers), list(logger.handlers), logger.level)
    try:
        for h in saved[0]:
            root.removeHandler(h)
        for h in saved[1]:
            logger.removeHandler(h)
        logger.setLevel(logging.NOTSET)
        assert logging_setup.show_progress(0) and logger.level == logging.INFO
        assert logging_setup.show_progress(1) and logger.level == logging.WARNING  # a second engine, rank 1
        assert len(logger.handlers) == 1
        logger.setLevel(logging.ERROR)  # the program's choice, after the handler was added
        assert not logging_setup.show_progress(0) and logger.level == logging.ERROR
        logging_setup.remove_handler()
        root.addHandler(logging.NullHandler())  # the program configured logging before initialize
        assert not logging_setup.show_progress(0) and not logger.handlers and logger.level == logging.NOTSET
    finally:
        logging_setup.remove_handler()
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in saved[0]:
            root.addHandler(h)
        for h in saved[1]:
            logger.addHandler(h)
        logger.setLevel(saved[2])
