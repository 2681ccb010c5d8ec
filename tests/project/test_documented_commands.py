"""Every command the documents give is covered: run here, run by a named test, or marked.

A command a reader copies from the README must run as written. This file extracts every shell
command of README.md, docs/**/*.md, bench/README.md and the module docstrings of examples/*.py
and bench/*.py, and checks each against COVERAGE, which says how it is covered:

* ``("run", timeout_s)`` or ``("run", timeout_s, exit_code)``: cheap CPU commands this file runs
  from the repository root; they must exit 0 (or the exit code the document gives).
  ``deepcompile ...`` runs as ``python -m deepcompile ...`` when the console script is missing.
* ``("test", "tests/<area>/<file>.py::<test>")``: an existing test runs the command (at smaller
  sizes). The test function must exist, and its file must name the command's script, module
  (``-m``) or ``deepcompile`` subcommand and the options and files after it, outside ``[...]``.
* ``("gpu", why)``: needs GPUs (NCCL, the H200 benches, Slurm); not run on CPU.
* ``("setup", why)``: installing or entering the tree, which CI itself does (.ci/run).

OPEN lists CPU commands that no test runs yet, with what is missing; test_no_open_commands fails
while it holds any (it is empty: every CPU command has its test).

What is extracted: the lines of fenced blocks marked bash/sh/shell (comments dropped), the
``$ `` lines of console blocks and of unmarked blocks holding any, and, in other unmarked blocks
and in the indented (literal) blocks of docstrings, lines that start with a program of PROGRAMS
(after ``VAR=value`` prefixes) and have no word ending in ``:`` (which marks printed output).
Lines ending in ``\\`` and, in docstrings, lines indented deeper than the command continue it;
whitespace is normalised and trailing ``# comments`` dropped.

A new documented command fails test_every_documented_command_is_covered, naming it: add it to
COVERAGE (an exact command, or a compiled pattern for a family). An entry no document gives any
more fails test_no_stale_entries."""
from __future__ import annotations

import ast
import os
import re
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from _harness.paths import ROOT

PROGRAMS = ("python", "python3", "torchrun", "accelerate", "deepcompile", "bash", "pip", "git")
_START = re.compile(r"^(?:\w+=\S*\s+)*(?:%s)\s" % "|".join(PROGRAMS))
_FENCE = re.compile(r"^( *)```(\w*)[^\n]*\n(.*?)^\1```", re.M | re.S)
SHELL = {"bash", "sh", "shell"}


def _strip_comment(line: str) -> str:
    """The line without a trailing ``# comment`` (a ``#`` after whitespace, outside quotes)."""
    for m in re.finditer(r"\s#", line):
        before = line[:m.start()]
        if before.count("'") % 2 == 0 and before.count('"') % 2 == 0:
            return before
    return line


def _normal(line: str) -> str:
    return " ".join(_strip_comment(line).split())


def _is_command(line: str) -> bool:
    return bool(_START.match(line + " ")) and not any(w.endswith(":") for w in line.split())


def _join(lines, deeper=False):
    """Joins lines ending in a backslash (and, with ``deeper``, lines indented more than the line
    they follow, as a docstring's usage continues); yields (indent, text)."""
    out = []
    for line in lines:
        indent = len(line) - len(line.lstrip())
        previous = out[-1] if out else (0, "")
        if previous[1].endswith("\\") or (deeper and line.strip() and previous[1] and indent > previous[0] > 0):
            out[-1] = (out[-1][0], out[-1][1].rstrip("\\") + " " + line.strip())
        else:
            out.append((indent, line.rstrip()))
    return out


def markdown_commands(text: str):
    for match in _FENCE.finditer(text):
        lang, lines = match.group(2), [t.strip() for _, t in _join(match.group(3).splitlines())]
        if lang in SHELL:
            yield from (line for line in lines if line and not line.startswith("#"))
        elif lang == "console" or (lang == "" and any(line.startswith("$ ") for line in lines)):
            yield from (line[2:] for line in lines if line.startswith("$ "))
        elif lang == "":
            yield from (line for line in lines if _is_command(line))


def docstring_commands(source: str):
    doc = ast.get_docstring(ast.parse(source)) or ""
    for indent, line in _join(doc.splitlines(), deeper=True):
        if indent > 0 and _is_command(line.strip()):
            yield line.strip()


def documented_commands():
    """{normalised command: [where it is documented]}."""
    found = {}
    documents = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "bench" / "README.md"]
    scripts = sorted((ROOT / "examples").glob("*.py")) + sorted((ROOT / "bench").glob("*.py"))
    for path in documents + scripts:
        text = path.read_text()
        commands = markdown_commands(text) if path.suffix == ".md" else docstring_commands(text)
        for command in map(_normal, commands):
            found.setdefault(command, []).append(str(path.relative_to(ROOT)))
    return found


# ---- how each command is covered ---------------------------------------------------------------

_TEST_EXAMPLES = "tests/project/test_examples.py::"
_TRAINER = "tests/integrations/test_hf_trainer.py::test_trainer_zero3_matches_single_process"
_ACCELERATE = "tests/integrations/test_hf_accelerate.py::"
_SLURM = "multi-node launch (Slurm, 2 nodes x 8 GPUs, NCCL)"
_GPU_BENCH = "a GPU benchmark (bench/README.md: H200 runs); its CPU checks are the tiny forms"

COVERAGE = {
    # The README's first block: what CI runs (tests/project/test_readme.py checks .ci/run has both).
    "bash scripts/setup.sh && torchrun --nproc-per-node 2 examples/train_llama.py":
        ("setup", ".ci/run runs it on a clean clone; test_readme.py checks it is CI's first command"),
    "bash scripts/run_tests.sh": ("setup", ".ci/run runs it (the whole suite)"),
    "pip install --no-build-isolation .": ("setup", "scripts/setup.sh installs the package so (-e), CI runs it"),
    "cd /path/to/deepcompile": ("setup", "entering the clone (bench/README.md, GPU machine)"),
    # The examples, as the README and their docstrings give them.
    "torchrun --nproc-per-node 2 examples/train_llama.py":
        ("test", _TEST_EXAMPLES + "test_train_llama_matches_single_process_training"),
    "torchrun --nproc-per-node 2 examples/train_llama.py [--steps 8] [--backend inductor|eager] [--cpu]":
        ("test", _TEST_EXAMPLES + "test_train_llama_matches_single_process_training"),
    "torchrun --nproc-per-node 2 examples/finetune.py":
        ("test", _TEST_EXAMPLES + "test_finetune_trains_checkpoints_resumes_and_exports"),
    re.compile(r"torchrun --nproc-per-node 2 examples/finetune\.py \[--model PATH\] .*"):
        ("test", _TEST_EXAMPLES + "test_finetune_trains_checkpoints_resumes_and_exports"),
    "torchrun --nproc-per-node 2 examples/ops_demo.py": ("test", _TEST_EXAMPLES + "test_ops_demo"),
    "torchrun --nproc-per-node 2 examples/hf_trainer.py --deepspeed examples/ds_config_zero3.json": ("test", _TRAINER),
    "torchrun --nproc-per-node 2 examples/hf_accelerate.py --ds-config examples/ds_config_zero3.json":
        ("test", _ACCELERATE + "test_accelerate_deepspeed_plugin_matches_single_process"),
    # accelerate's own launcher, through deepcompile (plain `accelerate launch` wants the real DeepSpeed).
    "python -m deepcompile.integrations.accelerate_launch --config_file examples/accelerate_deepspeed.yaml "
    "examples/hf_accelerate.py": ("test", _ACCELERATE + "test_accelerate_launch_config_file_matches_single_process"),
    "torchrun --nproc-per-node 2 --max-restarts 3 examples/elastic_restart.py [--out DIR] [--steps N] "
    "[--save-every K] [--cpu]": ("test", "tests/faults/test_faults.py::"
                                         "test_torchrun_restarts_after_a_killed_rank_and_ends_bitwise_as_an_uninterrupted_run"),
    "DC_TEST_KILL_AT=backward:5@1 torchrun --nproc-per-node 2 --max-restarts 1 examples/elastic_restart.py --cpu":
        ("test", "tests/faults/test_faults.py::"
                 "test_torchrun_restarts_after_a_killed_rank_and_ends_bitwise_as_an_uninterrupted_run"),
    # Multi-node.
    re.compile(r"torchrun --nnodes 2 --node-rank \$NODE_RANK .* examples/finetune\.py .*"): ("gpu", _SLURM),
    re.compile(r"export HOST0=\$\(scontrol .*"): ("gpu", _SLURM),
    re.compile(r"srun bash -c 'torchrun .* examples/finetune\.py .*'"): ("gpu", _SLURM),
    # The command-line tool.
    "deepcompile env": ("run", 60),
    "deepcompile check examples/finetune_config.json --world-size 8": ("run", 60),
    "deepcompile check examples/ds_config_zero3.json --world-size 8 --trainer": ("run", 60),
    "deepcompile export ckpt/ exported/":
        ("test", "tests/cli/test_cli.py::test_export_offline_equals_the_full_state_dict"),
    "deepcompile export checkpoints/ exported/":
        ("test", "tests/cli/test_cli.py::test_export_of_a_transformers_model_loads_with_from_pretrained"),
    "python -c \"from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained('exported')\"":
        ("test", "tests/cli/test_cli.py::test_export_of_a_transformers_model_loads_with_from_pretrained"),
    # Benchmarks: GPU runs, and the CPU checks of the scripts.
    "bash scripts/gpu_deepspeed.sh": ("gpu", "DeepSpeed peer rows on the GPU machine"),
    "DS_PRESET=8b DS_MICRO_BATCH=1 bash scripts/gpu_deepspeed.sh": ("gpu", "DeepSpeed peer rows on the GPU machine"),
    re.compile(r"bash bench/results/recipes/gpu_offload_7b\.sh \S+"): ("gpu", "7B offload recipe, one H200"),
    re.compile(r"(torchrun --nproc-per-node [12] |python3 )bench/train_bench\.py (?!--preset tiny --warmup 3 --steps 2$).*"):
        ("gpu", _GPU_BENCH + " (--merge reads the GPU recipes' JSON)"),
    re.compile(r"torchrun --nproc-per-node [12] bench/(compile_time|offload_bench|comm_bench)\.py .*"):
        ("gpu", _GPU_BENCH),
    re.compile(r"python3 bench/largest_model\.py --systems z3-offload-budget.*"): ("gpu", _GPU_BENCH),
    "torchrun --standalone --nproc-per-node 1 bench/checkpointing_memory.py --markdown bench/results/$(date -u +%F).md":
        ("gpu", _GPU_BENCH),
    "torchrun --nproc-per-node 1 bench/checkpointing_memory.py [--stages 3,1] [--markdown PATH]": ("gpu", _GPU_BENCH),
    re.compile(r"torchrun --nproc-per-node 1 bench/model_state_bench\.py --dir /tmp/state --markdown .*"):
        ("gpu", _GPU_BENCH),
    "python3 bench/largest_model.py --systems z3 --layers 1,2 -- --hidden 64 --heads 4 --intermediate 172 "
    "--vocab 256 --seq 64": ("test", "tests/bench/test_bench_tools.py::"
                                     "test_largest_model_reports_what_trains_and_why_the_rest_fails_on_cpu"),
    "torchrun --standalone --nproc-per-node 1 bench/checkpointing_memory.py --preset tiny":
        ("test", "tests/bench/test_bench_tools.py::"
                 "test_checkpointing_memory_runs_on_cpu_and_checkpointing_saves_only_layer_inputs"),
    "torchrun --nproc-per-node 1 bench/checkpointing_memory.py --preset tiny":
        ("test", "tests/bench/test_bench_tools.py::"
                 "test_checkpointing_memory_runs_on_cpu_and_checkpointing_saves_only_layer_inputs"),
    re.compile(r"python3 bench/largest_model\.py \[--systems .*"):
        ("test", "tests/bench/test_bench_tools.py::"
                 "test_largest_model_reports_what_trains_and_why_the_rest_fails_on_cpu"),
    re.compile(r"python3 bench/long_sequence_bench\.py \[--preset .*"):
        ("test", "tests/bench/test_long_sequence_bench.py::test_dc_trains_two_lengths_and_the_other_rows_say_why"),
    re.compile(r"python3? bench/step_account\.py .*"):
        ("test", "tests/bench/test_step_account.py::test_cli_prints_traces_side_by_side"),
    re.compile(r"python3 bench/multinode_model\.py \[.*"):
        ("test", "tests/bench/test_multinode_model.py::test_the_script_prints_both_tables"),
    re.compile(r"python3 bench/memory_peak\.py traces/.*"): ("gpu", "reads the allocator trace of a GPU run"),
    re.compile(r"python3 bench/pcie_bench\.py .*"): ("gpu", "host-device copy bandwidth"),
    re.compile(r"python3 bench/trainer_bench\.py --nproc 2 .*"): ("gpu", _GPU_BENCH + " (scripts/gpu_trainer_bench.sh)"),
    "torchrun --nproc-per-node 2 bench/train_bench.py --preset tiny --warmup 3 --steps 2":
        ("test", "tests/bench/test_train_bench_cpu_smoke.py::test_train_bench_cpu_smoke_runs_as_documented"),
    "torchrun --nproc-per-node 1 bench/model_state_bench.py --dir /tmp/state --tiny":
        ("test", "tests/bench/test_model_state_bench.py::test_model_state_bench_tiny_runs_every_phase"),
}

# CPU commands no test runs as given yet: command -> what is missing.
OPEN: dict = {}


def _covers(key, command: str) -> bool:
    return key == command if isinstance(key, str) else key.fullmatch(command) is not None


def coverage(command: str):
    return [how for key, how in COVERAGE.items() if _covers(key, command)]


DOCUMENTED = documented_commands()


def test_the_extractor_finds_the_documented_commands():
    assert len(DOCUMENTED) >= 50
    assert "README.md" in DOCUMENTED["deepcompile env"] and "docs/cli.md" in DOCUMENTED["deepcompile env"]
    assert "examples/elastic_restart.py" in DOCUMENTED[
        "DC_TEST_KILL_AT=backward:5@1 torchrun --nproc-per-node 2 --max-restarts 1 examples/elastic_restart.py --cpu"]
    # Printed output and prose are not commands; continued lines are joined.
    assert not [c for c in DOCUMENTED if c.startswith(("deepcompile:", "deepcompile test hook", "deepcompile/",
                                                       "deepcompile 0.1.0", "deepcompile compiles"))]
    assert any(c.endswith("[--save-every K] [--cpu]") for c in DOCUMENTED)
    assert any(c.startswith("torchrun --nnodes 2") and c.endswith("--out /shared/run") for c in DOCUMENTED)


def test_every_documented_command_is_covered():
    uncovered = {c: where for c, where in DOCUMENTED.items() if not coverage(c) and c not in OPEN}
    assert not uncovered, "documented commands with no entry in COVERAGE (run, test, gpu or setup):\n" + "\n".join(
        f"  {c}    ({', '.join(where)})" for c, where in uncovered.items())
    twice = {c: coverage(c) for c in DOCUMENTED if len(coverage(c)) + (c in OPEN) > 1}
    assert not twice, f"commands with more than one entry: {twice}"


def test_no_stale_entries():
    stale = [key for key in [*COVERAGE, *OPEN] if not any(_covers(key, c) for c in DOCUMENTED)]
    assert not stale, f"entries that no document gives any more: {stale}"


def _evidence(command: str):
    """What the covering test's file must name: the script (``x.py``), module (``-m``) or
    ``deepcompile`` subcommand, then the options and the .py/.json/.yaml files after it, outside
    [...] (a usage synopsis's optional parts). ``python -c`` code needs nothing named."""
    words = re.sub(r"\[[^\]]*\]", " ", command).split()
    for i, word in enumerate(words):
        if word in ("-m", "deepcompile") and i + 1 < len(words):
            start, name = i + 1, words[i + 1]
            break
        if word.endswith(".py"):
            start, name = i, os.path.basename(word)
            break
    else:
        return []
    named = [w.split("=")[0] for w in words[start + 1:] if w.startswith("--") and w != "--"]
    files = [os.path.basename(w) for w in words[start + 1:] if w.endswith((".py", ".json", ".yaml"))]
    return [name, *named, *files]


def test_tests_named_as_coverage_exist_and_run_the_command():
    problems = []
    for command in DOCUMENTED:
        for kind, detail in coverage(command):
            if kind == "test":
                path, _, name = detail.partition("::")
                source = (ROOT / path).read_text() if (ROOT / path).is_file() else ""
                if not re.search(rf"^def {re.escape(name)}\(", source, re.M):
                    problems.append(f"{detail}: no such test (for {command})")
                missing = [w for w in _evidence(command) if w not in source]
                if missing:
                    problems.append(f"{path} does not name {missing} of {command}")
            else:
                assert kind in ("run", "gpu", "setup"), (command, kind)
    assert not problems, "\n".join(problems)


def test_the_checks_see_a_gap():
    hf = "torchrun --nproc-per-node 2 examples/hf_trainer.py --deepspeed examples/ds_config_zero3.json"
    assert coverage(hf) and not coverage(hf + " --no-such-option") and not coverage("deepcompile env --json")
    assert _evidence(hf + " --no-such-option") == ["hf_trainer.py", "--deepspeed", "--no-such-option",
                                                   "ds_config_zero3.json"]
    assert _evidence("python -m pkg.launcher --config_file a.yaml b.py [--x]") == [
        "pkg.launcher", "--config_file", "a.yaml", "b.py"]
    assert list(markdown_commands("```\n$ deepcompile env\ndeepcompile 0.1.0 at /x\n```\n")) == ["deepcompile env"]


def _argv(command: str):
    argv = shlex.split(command)
    if argv[0] == "deepcompile" and shutil.which("deepcompile") is None:
        argv = [sys.executable, "-m", "deepcompile", *argv[1:]]
    elif argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    return argv


def test_the_cpu_commands_run_as_written():
    """The ``run`` entries, from the repository root, at once (each pays torch's import)."""
    runs = [(c, *how[1:]) for c in DOCUMENTED for how in coverage(c) if how[0] == "run"]
    assert runs
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")

    def run(item):
        command, timeout, expected = (*item, 0)[:3]
        done = subprocess.run(_argv(command), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        return command, done.returncode, expected, done.stdout[-2000:] + done.stderr[-2000:]

    with ThreadPoolExecutor(len(runs)) as pool:
        failed = [r[:2] + r[3:] for r in pool.map(run, runs) if r[1] != r[2]]
    assert not failed, "\n\n".join(f"{c}: exit {rc}\n{out}" for c, rc, out in failed)


def test_no_open_commands():
    assert not OPEN, "documented CPU commands no test runs:\n" + "\n".join(f"  {c}: {w}" for c, w in OPEN.items())
