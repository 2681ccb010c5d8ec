"""``accelerate launch`` with deepcompile served as DeepSpeed, for configs with
``distributed_type: DEEPSPEED``:

    python -m deepcompile.integrations.accelerate_launch --config_file cfg.yaml train.py [args]

takes exactly the arguments of ``accelerate launch``. The launcher process itself checks that
DeepSpeed is installed before it starts the ranks, so it has to see deepcompile's ``deepspeed``
too; the training script still calls ``deepcompile.serve_as_deepspeed()`` (each rank is a new
process).
"""

import sys


def main() -> None:
    from deepcompile.integrations.serve import serve_as_deepspeed  # deepcompile.serve_as_deepspeed

    serve_as_deepspeed()
    from accelerate.commands.launch import launch_command, launch_command_parser

    args = launch_command_parser().parse_args(sys.argv[1:])
    launch_command(args)


if __name__ == "__main__":
    main()
