"""DeepSpeed's ALST / Ulysses route served by deepcompile: accelerate's
``ParallelismConfig(sp_backend="deepspeed", sp_size=2)`` calls the served
``UlyssesSPAttentionHF.register_with_transformers``, ``UlyssesSPDataLoaderAdapter``,
``deepspeed.utils.groups._get_sequence_parallel_*`` and ``deepspeed.initialize(mpu=...)``, and the
engine splits every sequence over the two ranks (deepcompile/sequence_parallel/).

* Launched (torchrun, two gloo ranks, tests/_harness/hf_ulysses_worker.py): accelerate's own example
  loop at ZeRO-2 and transformers' Trainer at ZeRO-2 and ZeRO-3 (ZeRO-3 also on packed rows, with
  ``compile.packed_sequences``), each against one process training the same tiny Llama on the
  whole sequences (tests/_harness/ulysses_case.py): the loss of every step and the final parameters.
* In process (the modules imported from deepcompile.integrations.deepspeed_api directly, nothing
  served): the refusals, and on two pooled ranks the adapter's length and order.

Tolerance: fp32, rtol 1e-5 / atol 1e-6, as the sequence-parallel parity suite
(tests/sequence_parallel/): every head attends over the same tokens as in one process, so the runs
differ only in float summation order (the slices' means recombined by their token counts, the
gradient summed over two ranks); measured: losses and parameters within 5e-7. Training the batches in another
order, or each rank attending over its own slice, moves the losses by >1e-3.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from _harness import hf_launch, ulysses_case
from _harness.multiproc import run_distributed

WORKER = os.path.join(os.path.dirname(hf_launch.TRAINER_PROBE), "hf_ulysses_worker.py")
TOL = dict(rtol=1e-5, atol=1e-6)


@functools.lru_cache(maxsize=None)
def _reference(packed: bool = False):
    return ulysses_case.reference(packed=packed)


def _launch(tmp_path, mode: str, stage: int, *extra: str):
    out = tmp_path / f"{mode}.json"
    hf_launch.torchrun(WORKER, ["--mode", mode, "--stage", str(stage), "--output-dir", str(tmp_path / "o"),
                                "--out", str(out), *extra], nproc=2)
    return hf_launch.read_json(out)


def _check(result, packed: bool = False, param_tol=TOL):
    ref = _reference(packed)
    assert result["world_size"] == 2
    assert result["engine"] == "deepcompile.integrations.deepspeed_api.engine"  # deepcompile trained it
    assert result["sequence_parallel_size"] == 2
    assert result["rewritten_calls"] >= 2  # both layers' attention went through the all-to-alls
    steps = ulysses_case.ROWS // ulysses_case.MICRO_BATCH
    assert len(result["losses"]) == len(ref["losses"]) == steps
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"]), **TOL)
    assert set(result["params"]) == set(ref["params"])
    for name, value in ref["params"].items():
        got = torch.tensor(result["params"][name])
        torch.testing.assert_close(got, value, **param_tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.world_size(2)
def test_accelerate_alst_loop_zero2_matches_one_process(tmp_path):
    result = _launch(tmp_path, "accelerate", 2)
    # accelerate hands each rank half the loader's batches; the adapter makes it twice as long again
    assert result["loader_length"] == ulysses_case.ROWS // ulysses_case.MICRO_BATCH
    _check(result)
    # Evaluation runs uncompiled, without the all-to-alls: a slice of a batch is refused there.
    assert result["eval_refusal"] and "whole sequences" in result["eval_refusal"], result["eval_refusal"]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_alst_matches_one_process(tmp_path, stage):
    """transformers >= 5.25 back-propagates each rank's share of the loss (summed over the group),
    older releases the whole loss on every rank (averaged); at ZeRO-2 the share used to train with
    half the gradient. Run under both by the oldest-HF smoke (scripts/oldest_hf_smoke.sh)."""
    result = _launch(tmp_path, "trainer", stage)
    assert result["global_steps"] == ulysses_case.ROWS // ulysses_case.MICRO_BATCH
    _check(result)


@pytest.mark.world_size(2)
def test_trainer_alst_packed_rows_match_one_process(tmp_path):
    """Packed rows (positions restarting, compile.packed_sequences in the DeepSpeed config) through
    Trainer: the same as one process where transformers keeps attention inside each document."""
    packed, unpacked = _reference(packed=True), _reference()
    assert abs(packed["losses"][0] - unpacked["losses"][0]) > 1e-3  # the documents matter to the reference
    result = _launch(tmp_path, "trainer", 3, "--packed")
    # Parameters at Inductor's tolerance (rtol 1e-4, atol 1e-5): the masked attention kernels sum in
    # another order than the reference's, and AdamW moves an element by about lr per step whatever
    # its gradient's size, so an element with a near-zero gradient carries that rounding into its
    # value (measured: one element of 1536 at 3.5e-6 after 4 steps; the losses stay within 1e-5).
    _check(result, packed=True, param_tol=dict(rtol=1e-4, atol=1e-5))


# ---- in process: the served modules, nothing served as deepspeed --------------------------------


def _ulysses():
    from deepcompile.integrations.deepspeed_api.runtime.sequence_parallel import ulysses_sp

    return ulysses_sp


def _register(model, **overrides):
    kwargs = dict(model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=2,
                  micro_batch_size=2, seq_length=16, seq_length_is_variable=False, disable_in_eval=True)
    kwargs.update(overrides)
    return _ulysses().UlyssesSPAttentionHF.register_with_transformers(**kwargs)


@pytest.mark.parametrize("overrides, message", [
    (dict(core_attn_implementation="flash_attention_2"), "only"),
    (dict(core_attn_implementation="eager"), "only"),
    (dict(disable_in_eval=False), "disable_in_eval=False"),
    (dict(seq_length=15), "does not divide"),
    (dict(seq_length=None), "needs seq_length"),
    (dict(sequence_parallel_size=3, seq_length_is_variable=True), "attention heads"),
    (dict(micro_batch_size=0), "micro_batch_size"),
    (dict(max_length=32), "disagree"),
    (dict(model_name_or_path=object()), "Hugging Face model"),
    (dict(tile_mlp=True), "unexpected"),
])
def test_register_with_transformers_refusals(overrides, message):
    with pytest.raises((ValueError, TypeError), match=message):
        _register(ulysses_case.tiny_llama_sdpa(), **overrides)


def test_alst_tiled_computations_import_and_are_refused_naming_the_config_key():
    """ALST scripts import DeepSpeed's TiledMLP (and friends) to patch the model's MLP: the import
    works, the call is refused with the key whose graph pass does the same."""
    from deepcompile.integrations.deepspeed_api._missing import RefusedByDeepcompile

    ulysses_sp = _ulysses()
    for call, key in ((lambda: ulysses_sp.TiledMLP.apply(None, None, None), "tiled_mlp"),
                      (lambda: ulysses_sp.TiledFusedLogitsLoss.apply(None), "tiled_loss"),
                      (lambda: ulysses_sp.SequenceTiledCompute(None), "tiled_mlp"),
                      (lambda: ulysses_sp.sequence_tiled_compute(None), "tiled_loss")):
        with pytest.raises(RefusedByDeepcompile, match=key):
            call()


def test_register_refuses_a_model_without_sdpa():
    with pytest.raises(ValueError, match="attn_implementation='eager'.*sdpa"):
        _register(ulysses_case.tiny_llama_sdpa("eager"))


def test_register_size_one_is_off():
    assert _register(ulysses_case.tiny_llama_sdpa(), sequence_parallel_size=1) is None


def test_groups_refuse_without_sequence_parallelism():
    from deepcompile.integrations.deepspeed_api import ds_groups

    if _ulysses().registered() is None:
        for accessor in (ds_groups._get_sequence_parallel_group, ds_groups._get_sequence_parallel_world_size,
                         ds_groups._get_sequence_parallel_rank):
            with pytest.raises(RuntimeError, match="no sequence parallelism"):
                accessor()
    with pytest.raises(AttributeError, match="deepspeed.utils.groups._get_expert_parallel_group"):
        ds_groups._get_expert_parallel_group  # noqa: B018


def test_initialize_refuses_another_mpu():
    import deepcompile.integrations.deepspeed_api as served
    from deepcompile.integrations.deepspeed_api._missing import NotImplementedByDeepcompile

    with pytest.raises(NotImplementedByDeepcompile, match=r"deepspeed.initialize\(mpu=...\)"):
        served.initialize(model=torch.nn.Linear(2, 2), config={"zero_optimization": {"stage": 3}}, mpu=object())


def test_initialize_config_takes_the_mpu_size():
    import deepcompile.integrations.deepspeed_api as served
    from deepcompile.sequence_parallel import SequenceParallelGroups

    groups = SequenceParallelGroups(size=2, rank=0, group=None, group_ranks=[0, 1], data_parallel_size=1,
                                    data_parallel_rank=0)
    mpu = _ulysses().SequenceParallelMPU(groups, None, micro_batch_size=2, seq_length=None)
    cfg = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 2}
    assert served._with_sequence_parallel(cfg, mpu)["sequence_parallel_size"] == 2
    assert served._with_sequence_parallel({**cfg, "sequence_parallel_size": 2}, mpu)["sequence_parallel_size"] == 2
    with pytest.raises(ValueError, match="sequence_parallel_size is 4"):
        served._with_sequence_parallel({**cfg, "sequence_parallel_size": 4}, mpu)
    with pytest.raises(ValueError, match="micro_batch_size=2"):
        served._with_sequence_parallel({**cfg, "train_micro_batch_size_per_gpu": 3}, mpu)


def test_adapter_single_rank_and_refusals():
    ulysses_sp = _ulysses()
    tokens = torch.arange(12).view(2, 6)
    adapter = ulysses_sp.UlyssesSPDataLoaderAdapter([{"input_ids": tokens, "labels": tokens}] * 3, sp_rank=0,
                                                    sp_group=None, sp_world_size=1, device="cpu")
    assert len(adapter) == 3
    batches = list(adapter)
    assert len(batches) == 3 and torch.equal(batches[0]["input_ids"], tokens)
    assert torch.equal(batches[0]["shift_labels"][:, :-1], tokens[:, 1:])
    assert (batches[0]["shift_labels"][:, -1] == -100).all()
    with pytest.raises(ValueError, match="sp_rank 1 is not a rank of 1"):
        ulysses_sp.UlyssesSPDataLoaderAdapter([], sp_rank=1, sp_group=None, sp_world_size=1, device="cpu")
    with pytest.raises(ValueError, match="sp_group must be"):
        ulysses_sp.UlyssesSPDataLoaderAdapter([], sp_rank=0, sp_group=None, sp_world_size=2, device="cpu")
    odd = ulysses_sp.UlyssesSPDataLoaderAdapter([{"input_ids": tokens, "token_type_ids": tokens}], sp_rank=0,
                                                sp_group=None, sp_world_size=1, device="cpu")
    with pytest.raises(ValueError, match="token_type_ids"):
        list(odd)


def _adapter_body(ctx):
    """Two ranks, each its own loader of two batches: the adapter yields rank 0's first batch, then
    rank 1's first, then the second ones, each rank its half of every sequence."""
    ulysses_sp = _ulysses()
    from deepcompile.integrations.deepspeed_api import ds_groups

    mpu = _register(ulysses_case.tiny_llama_sdpa(), seq_length=8)
    assert mpu.get_sequence_parallel_world_size() == 2 and mpu.get_sequence_parallel_rank() == ctx.rank
    assert mpu.get_data_parallel_world_size() == 1 and mpu.get_data_parallel_rank() == 0
    assert torch.distributed.get_world_size(mpu.get_data_parallel_group()) == 1
    assert mpu.get_sequence_data_parallel_world_size() == 2
    assert ds_groups._get_sequence_parallel_group() is mpu.get_sequence_parallel_group()
    assert ds_groups._get_sequence_parallel_world_size() == 2
    assert ds_groups._get_sequence_parallel_rank() == ctx.rank

    def batch(index):  # batch `index` of this rank's loader: rows numbered by rank and index
        ids = torch.arange(8).expand(2, 8) + 100 * (10 * ctx.rank + index) + 1000 * torch.arange(2).unsqueeze(1)
        return {"input_ids": ids.clone(), "labels": ids.clone()}

    adapter = ulysses_sp.UlyssesSPDataLoaderAdapter([batch(0), batch(1)], sp_rank=mpu.get_sequence_parallel_rank(),
                                                    sp_group=mpu.get_sequence_parallel_group(), sp_world_size=2,
                                                    device="cpu")
    assert len(adapter) == 4
    got = list(adapter)
    lo, hi = 4 * ctx.rank, 4 * (ctx.rank + 1)
    for step, (owner, index) in enumerate([(0, 0), (1, 0), (0, 1), (1, 1)]):
        whole = torch.arange(8).expand(2, 8) + 100 * (10 * owner + index) + 1000 * torch.arange(2).unsqueeze(1)
        assert torch.equal(got[step]["input_ids"], whole[:, lo:hi]), (step, got[step]["input_ids"])
        assert torch.equal(got[step]["position_ids"], torch.arange(lo, hi).expand(2, 4))
        shifted = torch.cat([whole[:, 1:], torch.full((2, 1), -100)], dim=1)
        assert torch.equal(got[step]["shift_labels"], shifted[:, lo:hi])
        assert got[step]["labels"] is got[step]["shift_labels"]
    wrong_length = ulysses_sp.UlyssesSPDataLoaderAdapter(
        [{"input_ids": torch.zeros(2, 6, dtype=torch.long)}], sp_rank=ctx.rank,
        sp_group=mpu.get_sequence_parallel_group(), sp_world_size=2, device="cpu")
    with pytest.raises(ValueError, match="seq_length=8"):
        list(wrong_length)


@pytest.mark.world_size(2)
def test_adapter_gathers_the_group_batches_in_rank_order():
    run_distributed(_adapter_body, world_size=2, timeout=120)
