"""``python -m deepcompile``: the command line tools (deepcompile/cli/)."""

import sys

from deepcompile.cli import main

sys.exit(main())
