"""Where the repository and its test folder are, for tests that read its files or run its scripts.

Test files live one folder below ``tests/`` (``tests/<area>/``, mirroring the package); counting
parent folders from each test file would be right until the next move and then point at the wrong
folder, or, behind an ``exists()`` check, silently skip. This file's own place is fixed."""
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
ROOT = TESTS.parent
