"""The ``deepcompile`` command (``python -m deepcompile`` before the package is installed):

* ``deepcompile env``: what this machine offers (torch, CUDA, NCCL, compilers, GPUs, and whether
  deepcompile's runtime was built with its NCCL path);
* ``deepcompile check ds_config.json --world-size N``: the config's whole validation report and
  the values its ``"auto"`` keys resolve to;
* ``deepcompile export CKPT_DIR OUT_DIR``: a checkpoint to one safetensors folder, offline (one
  process, no GPU, no process group), as DeepSpeed's ``zero_to_fp32.py``.

One module per subcommand, each with ``add_parser(subparsers)`` and ``run(args) -> exit code``.
Usage text for users: docs/cli.md.
"""

from __future__ import annotations

import argparse
from typing import List, Optional

from deepcompile.cli import check, env, export

COMMANDS = {"env": env, "check": check, "export": export}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepcompile", description="deepcompile's command line tools (docs/cli.md)")
    sub = p.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    sub.required = True
    for name, module in COMMANDS.items():
        module.add_parser(sub)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    return COMMANDS[args.command].run(args)
