"""The repository's documents point only at files that exist.

Files move (results into bench/results/, recipes beside them, packages split), and a moved file
must not leave a reference behind that sends a newcomer nowhere. This reads the documents a reader
starts from and checks every repository path they name, in code spans, fenced blocks and links,
and every link's section anchor into a Markdown file."""
import re

import pytest

from _harness.paths import ROOT

PACKAGE = ROOT / "deepcompile"

# The documents a newcomer reads first; the dated files under bench/results/ are history and keep
# the paths as they were when the run happened.
DOCUMENTS = sorted(
    {ROOT / "README.md", ROOT / "NOTES.md", ROOT / "bench" / "README.md", ROOT / "bench" / "RESULTS.md",
     ROOT / "tests" / "README.md"}
    | set((ROOT / "docs").rglob("*.md"))
)

_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_CODE_SPAN = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
_EXTENSION = re.compile(r"\.[A-Za-z][A-Za-z0-9]*$")
# Placeholders, variables, globs and alternatives name no single file.
_NOT_A_FILE = set("<>$*{}|[]")


def slug(heading):
    """The anchor a Markdown renderer (GitHub's) gives a heading: lower case, punctuation dropped,
    each space a hyphen."""
    text = re.sub(r"`|\*\*|\*", "", heading).strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(markdown):
    """Every heading's anchor; a repeated heading gets -1, -2, ... as on GitHub."""
    seen, found = {}, set()
    for heading in _HEADING.findall(_FENCE.sub("", markdown)):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def _path_like(token):
    """The repository path a token names, or None: it has a '/' and ends with a file extension or
    a '/', and it is not absolute, a URL or a placeholder."""
    token = token.strip("'\".,;:()")
    token = token.split("::")[0]
    token = re.sub(r":\d+$", "", token)
    if "/" not in token or token.startswith(("/", "~", ".", "http:", "https:", "-")):
        return None
    if _NOT_A_FILE & set(token) or token[0].isdigit():
        return None
    if not (token.endswith("/") or _EXTENSION.search(token)):
        return None
    return token


def _exists(path):
    """A path counts as the repository's when its first part is a top-level entry of the
    repository or of the package (package-relative paths such as `offload/plan.py` are the
    documents' habit); paths of other projects (`torch/...`) are not checked."""
    first = path.split("/", 1)[0]
    bases = [base for base in (ROOT, PACKAGE) if (base / first).exists()]
    if not bases:
        return True
    return any((base / path).exists() for base in bases)


def mentioned_paths(markdown):
    """Repository paths named in code spans and fenced blocks, split into words."""
    code = _FENCE.findall(markdown) + _CODE_SPAN.findall(_FENCE.sub("", markdown))
    paths = []
    for text in code:
        for token in re.split(r"[\s=,]+", text):
            path = _path_like(token)
            if path:
                paths.append(path)
    return paths


def dangling(document):
    """(what, why) for every reference of one document that leads nowhere."""
    text = document.read_text()
    problems = [(path, "no such file") for path in mentioned_paths(text) if not _exists(path)]
    for target in _LINK.findall(_FENCE.sub("", text)):
        if re.match(r"[a-z]+:", target):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (document.parent / file_part).resolve() if file_part else document
        if not linked.exists():
            problems.append((target, "no such file"))
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text()):
            problems.append((target, "no such section"))
    return problems


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_document_names_exists(document):
    problems = dangling(document)
    assert not problems, f"{document.relative_to(ROOT)} points nowhere: " + "; ".join(
        f"{what} ({why})" for what, why in problems
    )


def test_the_checker_sees_moved_files_and_missing_sections(tmp_path):
    # A path of this repository that does not exist is caught; one of another project is not.
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\nRun `bash scripts/no_such_recipe.sh` and read `torch/distributed/fsdp/x.py`,\n"
        "`offload/no_such_module.py`, `bench/README.md` and [this](#title), [that](#nowhere).\n"
        "```\npython3 bench/no_such_bench.py --markdown $OUT/x.md\n```\n"
    )
    found = {what for what, _ in dangling(page)}
    assert found == {"scripts/no_such_recipe.sh", "offload/no_such_module.py",
                     "bench/no_such_bench.py", "#nowhere"}


def test_slug_matches_the_renderers_anchors():
    assert slug("2026-11-26 08:49 UTC, the GPU side by side, 1 x NVIDIA H100") == (
        "2026-11-26-0849-utc-the-gpu-side-by-side-1-x-nvidia-h100")
    assert slug("Where the compile time goes: `bench/compile_time.py`") == (
        "where-the-compile-time-goes-benchcompile_timepy")
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}
