"""Where a checkpoint lives on disk and how a save becomes visible (DeepSpeed's layout).

``<dir>/<tag>/`` holds one checkpoint (DCP's ``.metadata`` and ``__<rank>_<n>.distcp`` files plus
``deepcompile.json``); ``<dir>/latest`` names the last tag saved with ``save_latest``.

A save writes into ``<dir>/<tag>.tmp-<nonce>`` and is committed last, by rank 0, with a rename:
a save cut off before that (a rank died, the job was killed) leaves only the ``.tmp-`` directory,
which loading never takes for a checkpoint, and the checkpoint that was there before, and
``latest``, are untouched. Re-saving an existing tag swaps the directories (the old one is
renamed aside to ``<tag>.replaced-<nonce>`` first and removed only once the new one is in place);
a save killed between the two renames leaves no ``<tag>``, and loading ``<tag>`` then takes the
copy renamed aside, which is complete. ``latest`` is replaced atomically (written aside, then
``os.replace``). The next commit of a tag removes what cut-off saves of it left.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Dict, List

from deepcompile.checkpoint.agreement import CheckpointError
from deepcompile.faults.injection import kill_point

LATEST = "latest"
META_FILE = "deepcompile.json"
DCP_METADATA = ".metadata"  # written by DCP's FileSystemWriter when every rank has finished
TMP_MARK = ".tmp-"
ASIDE_MARK = ".replaced-"
FORMAT = "deepcompile-dcp"
VERSION = 1


def check_tag(tag: str) -> None:
    if not isinstance(tag, str) or not tag.strip():
        raise CheckpointError(f"a checkpoint tag must be a non-empty string, got {tag!r}")
    if os.sep in tag or (os.altsep and os.altsep in tag) or tag in (".", "..", LATEST):
        raise CheckpointError(f"checkpoint tag {tag!r} cannot be a path or {LATEST!r}")
    if TMP_MARK in tag or ASIDE_MARK in tag:
        raise CheckpointError(f"checkpoint tag {tag!r} cannot contain {TMP_MARK!r} or {ASIDE_MARK!r} "
                              "(reserved for saves in progress)")


def temporary_path(save_dir: str, tag: str, nonce: str) -> str:
    return os.path.join(save_dir, f"{tag}{TMP_MARK}{nonce}")


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # not every filesystem syncs directories
    finally:
        os.close(fd)


def write_json(path: str, obj: Dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True, default=str)
        f.flush()
        os.fsync(f.fileno())


def commit(tmp: str, final: str) -> None:
    """Make the finished save ``tmp`` the checkpoint ``final`` (rank 0)."""
    aside = None
    if os.path.lexists(final):
        aside = f"{final}{ASIDE_MARK}{os.path.basename(tmp).rsplit(TMP_MARK, 1)[1]}"
        os.rename(final, aside)
        kill_point("save:commit_aside")  # tests: no <tag> now, only its copy aside (see resolve)
    try:
        os.rename(tmp, final)
    except BaseException:
        if aside is not None:
            os.rename(aside, final)
        raise
    _fsync_dir(os.path.dirname(final))
    # The copy aside, and what earlier saves of this tag left when they were cut off.
    parent, tag = os.path.split(final)
    for name in os.listdir(parent):
        if name.startswith(tag + ASIDE_MARK) or name.startswith(tag + TMP_MARK):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def write_latest(save_dir: str, tag: str, nonce: str) -> None:
    staged = os.path.join(save_dir, f"{LATEST}{TMP_MARK}{nonce}")
    with open(staged, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    kill_point("save:latest_staged")
    os.replace(staged, os.path.join(save_dir, LATEST))
    _fsync_dir(save_dir)


def _entries(load_dir: str) -> List[str]:
    return sorted(os.listdir(load_dir))


def _cut_off(names: List[str], tag: str = "") -> List[str]:
    return [n for n in names if TMP_MARK in n and n.startswith(tag) and not n.startswith(LATEST + TMP_MARK)]


def _complete_tags(load_dir: str, names: List[str]) -> List[str]:
    return [n for n in names if TMP_MARK not in n and ASIDE_MARK not in n
            and os.path.isfile(os.path.join(load_dir, n, META_FILE))]


def _renamed_aside(load_dir: str, names: List[str], tag: str) -> List[str]:
    """Complete copies of ``tag`` that a re-save renamed aside, newest first: what is left of
    ``tag`` when that save was killed between its two renames."""
    found = [os.path.join(load_dir, n) for n in names if n.startswith(tag + ASIDE_MARK)]
    found = [p for p in found if all(os.path.isfile(os.path.join(p, f)) for f in (META_FILE, DCP_METADATA))]
    return sorted(found, key=os.path.getmtime, reverse=True)


def resolve(load_dir: str, tag: Any) -> str:
    """The directory of checkpoint ``tag`` in ``load_dir`` (``None``: the one ``latest`` names),
    or a :class:`CheckpointError` that says what is wrong with what is there."""
    load_dir = os.fspath(load_dir)
    if not os.path.exists(load_dir):
        raise CheckpointError(f"checkpoint directory {load_dir!r} does not exist")
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"checkpoint directory {load_dir!r} is not a directory")
    names = _entries(load_dir)
    if tag is None:
        latest = os.path.join(load_dir, LATEST)
        if not os.path.isfile(latest):
            if not names:
                raise CheckpointError(f"checkpoint directory {load_dir!r} is empty: there is no checkpoint to load")
            complete, partial = _complete_tags(load_dir, names), _cut_off(names)
            if complete:
                raise CheckpointError(f"checkpoint directory {load_dir!r} has no {LATEST!r} file naming the checkpoint "
                                      f"to load; pass tag= one of {complete}")
            if partial:
                raise CheckpointError(f"checkpoint directory {load_dir!r} holds only saves that were cut off before "
                                      f"they were committed ({', '.join(partial)}): there is no complete checkpoint")
            raise CheckpointError(f"checkpoint directory {load_dir!r} holds no checkpoint (no {LATEST!r} file and no "
                                  f"checkpoint directories; found {names[:10]})")
        with open(latest) as f:
            tag = f.read().strip()
        if not tag:
            raise CheckpointError(f"{latest!r} is empty: it names no checkpoint")
    else:
        tag = str(tag)
    check_tag(tag)
    path = os.path.join(load_dir, tag)
    if not os.path.isdir(path) and _renamed_aside(load_dir, names, tag):
        path = _renamed_aside(load_dir, names, tag)[0]
    if not os.path.isdir(path):
        partial = _cut_off(names, tag + TMP_MARK)
        if partial:
            raise CheckpointError(f"checkpoint {tag!r} in {load_dir!r} was never committed: its save was cut off "
                                  f"({', '.join(partial)} is a partial write)")
        raise CheckpointError(f"there is no checkpoint {tag!r} in {load_dir!r}; complete checkpoints there: "
                              f"{_complete_tags(load_dir, names)}")
    missing = [n for n in (META_FILE, DCP_METADATA) if not os.path.isfile(os.path.join(path, n))]
    if missing:
        raise CheckpointError(f"{path!r} is not a complete deepcompile checkpoint: it lacks {', '.join(missing)}")
    return path


def read_meta(path: str) -> Dict[str, Any]:
    where = os.path.join(path, META_FILE)
    try:
        with open(where) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {where!r}: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{where!r} does not describe a deepcompile checkpoint (format {meta.get('format')!r})"
                              if isinstance(meta, dict) else f"{where!r} does not describe a deepcompile checkpoint")
    if meta.get("version", 0) > VERSION:
        raise CheckpointError(f"{path!r} is format version {meta['version']}; this deepcompile reads up to {VERSION}")
    return meta
