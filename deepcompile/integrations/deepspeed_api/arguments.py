"""``deepspeed.add_config_arguments(parser)``: the command-line options through which DeepSpeed
scripts (DeepSpeedExamples, all of DeepSpeed-Chat, Megatron-DeepSpeed) take their config.

``--deepspeed_config`` is what ``deepspeed.initialize(args=...)`` reads when no config is passed
(``args.deepspeed_config``); ``--deepspeed`` is the flag scripts test to take their DeepSpeed path.
"""

from __future__ import annotations

import argparse


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed options (served by deepcompile)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="run through deepspeed (here: deepcompile's engine)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="the DeepSpeed config file (JSON) deepspeed.initialize(args=...) reads")
    return parser
