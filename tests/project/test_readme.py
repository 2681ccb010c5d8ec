"""The README tells the truth where code can check it.

A front door that drifts from the code misleads exactly the reader who knows least. Checked here:
the layout names every top-level folder and every subpackage (and nothing that is gone); the two
commands at the top are the ones CI runs; the support matrix's stages, precisions, offload kinds
and versions are what the config accepts and the packaging declares; and every
``deepcompile.<name>`` and ``engine.<name>`` the README and the migration guide mention exists."""
from __future__ import annotations

import fnmatch
import importlib
import re
from pathlib import Path

import pytest

from deepcompile import Config, Engine
from deepcompile.config import ConfigError

from _harness.paths import ROOT

README = (ROOT / "README.md").read_text()
GUIDE = ROOT / "docs" / "migrating-from-deepspeed.md"
TOP_COMMANDS = ("bash scripts/setup.sh && torchrun --nproc-per-node 2 examples/train_llama.py",
                "bash scripts/run_tests.sh")


def section(markdown: str, title: str) -> str:
    """The text under ``## title`` up to the next second-level heading."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", markdown, re.M | re.S)
    assert match, f"README has no section '## {title}'"
    return match.group(1)


def support_matrix() -> dict:
    """First cell -> (supported, notes) of the table under "Is it for you?"."""
    rows = {}
    for line in section(README, "Is it for you?").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 3 and cells[0] and not set(cells[0]) <= set("- "):
            rows[cells[0]] = (cells[1], cells[2])
    return rows


def accepts(config: dict) -> bool:
    try:
        Config.from_any(config)
    except ConfigError:
        return False
    return True


def _ignored_names():
    """Folder patterns .gitignore excludes (build outputs, caches): not part of the layout."""
    lines = (ROOT / ".gitignore").read_text().splitlines()
    return [line.strip().strip("/") for line in lines if line.strip().endswith("/")]


# ---- layout ------------------------------------------------------------------------------------


def layout_entries():
    """(top-level entries, entries indented two spaces under deepcompile/) of the layout's fenced
    block; lines indented further continue a description."""
    block = re.search(r"```\n(.*?)```", section(README, "Layout"), re.S).group(1)
    top, nested = set(), set()
    for line in block.splitlines():
        if re.match(r"\S", line):
            top.add(line.split()[0])
        elif re.match(r"  \S", line):
            nested.add(line.split()[0])
    return top, nested


def test_layout_names_every_top_level_folder_and_subpackage():
    top, nested = layout_entries()
    ignored = _ignored_names()
    folders = {d.name for d in ROOT.iterdir() if d.is_dir() and not d.name.startswith(".")
               and not any(fnmatch.fnmatch(d.name, pattern) for pattern in ignored)}
    subpackages = {d.name for d in (ROOT / "deepcompile").iterdir() if (d / "__init__.py").exists()}
    missing_top = sorted(name for name in folders if f"{name}/" not in top)
    missing_nested = sorted(name for name in subpackages if f"{name}/" not in nested)
    assert not missing_top, f"top-level folders missing from the README's layout: {missing_top}"
    assert not missing_nested, f"deepcompile/ subpackages missing from the README's layout: {missing_nested}"
    # And nothing the layout names is gone.
    gone = [t for t in top if not (ROOT / t).exists()] + [n for n in nested if not (ROOT / "deepcompile" / n).exists()]
    assert not gone, f"the layout names what does not exist: {gone}"


def test_layout_parsing_sees_both_levels():
    top, nested = layout_entries()
    assert "deepcompile/" in top and "zero/" in nested
    assert "zero/" not in top and "build/" not in top  # build/ is ignored output


# ---- the commands at the top -------------------------------------------------------------------


def test_the_first_commands_are_the_ones_ci_runs():
    first_block = re.search(r"```bash\n(.*?)```", README, re.S).group(1).splitlines()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for command in TOP_COMMANDS:
        assert command in first_block, f"README's first block lost {command!r}"
        assert command in ci, f".ci/run no longer runs {command!r}"


# ---- the support matrix ------------------------------------------------------------------------


def test_matrix_stages_are_the_stages_the_config_accepts():
    listed = {int(s) for s in re.findall(r"\d", support_matrix()["ZeRO stages"][0])}
    accepted = {s for s in range(0, 6) if accepts({"zero_optimization": {"stage": s}})}
    assert listed == accepted


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_matrix_precisions_are_what_the_config_accepts(precision):
    supported, notes = support_matrix()["precision"]
    config = {"zero_optimization": {"stage": 3}, precision: {"enabled": True}}
    assert accepts(config) == (precision in supported)
    if precision not in supported:
        assert f"{precision} is refused" in notes


def test_matrix_offload_kinds_are_what_the_config_accepts():
    supported, notes = support_matrix()["offload to host memory"]
    cpu = {"device": "cpu"}

    def zero(stage, **offload):
        return {"zero_optimization": {"stage": stage, **offload}}

    assert "optimizer states (every stage)" in supported
    assert all(accepts(zero(s, offload_optimizer=cpu)) for s in (1, 2, 3))
    assert "parameters (ZeRO-3)" in supported
    assert accepts(zero(3, offload_param=cpu))
    assert not accepts(zero(1, offload_param=cpu)) and not accepts(zero(2, offload_param=cpu))
    assert "activations" in supported
    assert accepts({**zero(3), "compile": {"offload_activation": True}})
    assert "NVMe is refused" in notes
    nvme = {"device": "nvme", "nvme_path": "/tmp"}
    assert not accepts(zero(3, offload_optimizer=nvme)) and not accepts(zero(3, offload_param=nvme))


def test_matrix_versions_are_the_packaging_ones():
    matrix = support_matrix()
    torch_min = re.fullmatch(r">= (\d+\.\d+)", matrix["torch"][0]).group(1)
    python_min = re.fullmatch(r">= (\d+\.\d+)", matrix["Python"][0]).group(1)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"torch>={torch_min}"' in pyproject  # dependencies and build requirements
    assert pyproject.count(f'"torch>={torch_min}"') == 2
    assert f'requires-python = ">={python_min}"' in pyproject
    major, minor = torch_min.split(".")
    assert f">= ({major}, {minor})" in (ROOT / "scripts" / "setup.sh").read_text()


@pytest.mark.parametrize("package", ["transformers", "accelerate"])
def test_matrix_hugging_face_versions_are_the_requirements_ones(package):
    """The lowest version the table claims is the bound requirements-dev.txt and the test extra
    declare, and the version installed here (what CI tests) meets it."""
    from importlib.metadata import version

    low = re.fullmatch(r">= (\d+\.\d+)", support_matrix()[package][0]).group(1)
    assert f"{package}>={low}" in (ROOT / "requirements-dev.txt").read_text().splitlines()
    assert f'"{package}>={low}"' in (ROOT / "pyproject.toml").read_text()

    def parts(v):
        return tuple(int(x) for x in re.match(r"\d+(?:\.\d+)*", v).group(0).split(".")[:2])

    assert parts(version(package)) >= parts(low), f"{package} {version(package)} is older than the claimed {low}"


# ---- the performance numbers -------------------------------------------------------------------

RESULTS = (ROOT / "bench" / "RESULTS.md").read_text()
_MEASURE = re.compile(r"\d[\d,]*(?:\.\d+)? ?(?:ms|GiB|tokens/s|x\b|s\b|B\b)")


def performance_rows(markdown: str):
    """(measurements, date) of each row of the Performance table: the measurements of its result
    columns (not the GPUs column, whose "2 x" reads as a ratio, nor the command)."""
    rows = []
    for line in section(markdown, "Performance").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 6 or set(cells[0]) <= set("- ") or cells[0] == "model":
            continue
        date = re.search(r"\d{4}-\d\d-\d\d", cells[1])
        rows.append((_MEASURE.findall(" | ".join(cells[2:-1])), date.group(0) if date else None))
    return rows


def stale_or_missing(markdown: str, results: str):
    """README numbers on no row of the results page, or quoted with a date other than that row's."""
    lines = [line for line in results.splitlines() if line.startswith("|")]
    bad = []
    for numbers, date in performance_rows(markdown):
        bad += [n for n in numbers if n not in results]
        home = [line for line in lines if numbers and numbers[0] in line]
        if not date or not any(date in line for line in home):
            bad.append(f"row of {numbers[:1]}: date {date} is not its results row's")
    return bad


def test_performance_numbers_are_the_results_pages():
    assert len(performance_rows(README)) >= 5, "the Performance table lost its rows"
    assert "bench/RESULTS.md" in section(README, "Performance")
    assert not stale_or_missing(README, RESULTS)


def test_the_performance_checker_sees_a_number_the_page_lacks():
    row = "| 1B | 2 x H200 (2), 2026-11-24 | ZeRO-3: 73.7 ms, 12.38 GiB | FSDP2: 118.8 ms | 1.61x | `cmd` |"
    fake = "## Performance\n\n| model | a | b | c | d | e |\n| --- | --- | --- | --- | --- | --- |\n" + row + "\n"
    assert {"73.7 ms", "1.61x"} <= set(stale_or_missing(fake, RESULTS))
    # A number that is on the page, quoted with an older date than its row's.
    old = row.replace("73.7 ms, 12.38 GiB", "82.5 ms, 10.64 GiB").replace("118.8 ms", "114.2 ms").replace(
        "1.61x", "1.38x")
    assert stale_or_missing(fake.replace(row, old), RESULTS) == ["row of ['82.5 ms']: date 2026-11-24 is not its "
                                                                 "results row's"]


# ---- the APIs the documents name ---------------------------------------------------------------


def _resolves(dotted: str) -> bool:
    """``deepcompile.a.b.C`` names an importable module or an attribute of one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


ENGINE_SOURCE = Path(importlib.import_module("deepcompile.engine").__file__).read_text()


def _engine_has(name: str) -> bool:
    return hasattr(Engine, name) or re.search(rf"\bself\.{name}\b\s*(:[^=]*)?=", ENGINE_SOURCE) is not None


@pytest.mark.parametrize("document", [ROOT / "README.md", GUIDE], ids=lambda p: p.name)
def test_every_api_a_document_names_exists(document):
    text = document.read_text()
    modules = sorted(set(re.findall(r"\bdeepcompile\.([A-Za-z_][\w.]*[\w])", text)))
    # engine.<attribute>, not the file engine.py
    engine = sorted(set(re.findall(r"(?<![\w./])engine\.([A-Za-z_]\w*)", text)) - {"py"})
    assert modules and engine
    missing = [f"deepcompile.{m}" for m in modules if not _resolves(f"deepcompile.{m}")]
    missing += [f"engine.{e}" for e in engine if not _engine_has(e)]
    assert not missing, f"{document.name} names what does not exist: {missing}"


def test_the_api_checker_sees_a_missing_name():
    assert _resolves("deepcompile.checkpoint.agreement.CheckpointError")
    assert not _resolves("deepcompile.no_such_function")
    assert _engine_has("save_hf") and _engine_has("lr_scheduler") and not _engine_has("save_16bit_model")


def test_hugging_face_snippets_are_copied_from_the_examples_the_tests_run():
    """Each Python block of "From Hugging Face Trainer and accelerate" is a verbatim excerpt of
    one of the example scripts that tests/integrations/test_hf_trainer.py and tests/integrations/test_hf_accelerate.py run,
    so the README cannot show code that no test runs."""
    text = section(README, "From Hugging Face Trainer and accelerate")
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 2, "the section lost its code blocks"
    examples = {name: (ROOT / "examples" / name).read_text() for name in ("hf_trainer.py", "hf_accelerate.py")}
    for block in blocks:
        assert any(block in source for source in examples.values()), (
            "this README block is in neither examples/hf_trainer.py nor examples/hf_accelerate.py:\n" + block)
    for name in examples:
        assert f"examples/{name}" in text, f"the section does not name examples/{name}"
