"""The files of ``data=text``: which files a corpus is (``discover``), and what each holds (``FileFacts``).

A corpus of many files is a start-up cost before any data is read: a run validates its config (three
times: the pre-launch check, the run, the build) and then reads the documents, and each needs the list of
files. ``_walk`` lists a folder with ``os.scandir`` (strings and the entries' own stats, no ``Path`` and
``stat`` per file) and keeps the walk for the process while no folder's modification time changed;
``discover`` keeps its result while every walk is kept and every file named directly is unchanged.
``FileFacts`` remembers each file's size, SHA-256 and whether it is text across processes, by (size,
mtime, inode), so a start does not hash the corpus again. Measured on 1 GB in ~56,000 files
(docs/benchmarks.md, "Data at scale"). A file or folder changed in the last ``RACY_NS`` is never
remembered: its mtime may not move on a rewrite within the filesystem's clock tick.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import time
from collections import Counter
from pathlib import Path
from typing import Any

from xfam.core.logs import log

#: Folders never walked: caches, installed third-party code and hidden folders (.git ...).
SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


#: A file or folder modified less than this long ago is not remembered (its mtime may not move on a rewrite).
RACY_NS = 2_000_000_000
#: Walks of this process: (root, extensions) -> (the walk, {folder: mtime_ns}); see ``_walk``.
_WALKS: dict[tuple[str, tuple[str, ...]], tuple[Any, dict[str, int]]] = {}


def _walk(root: Path, extensions: list[str]) -> tuple[list[tuple[str, Path, tuple[int, int]]], Counter]:
    """Non-empty files under ``root`` ending in one of ``extensions`` as ``(path relative to root, path,
    (device, inode))`` in path order, and a count of all suffixes seen.

    Strings and ``os.scandir`` entries (which carry their type and stat), not a ``Path`` and a ``stat`` per
    file: a folder of ~56,000 files is walked in ~0.5 s instead of ~3.5 s. A run validates its config and
    then reads the documents, so the same folder is walked again in one process: the walk is kept while no
    folder's modification time changed (adding, removing or renaming a file changes its folder's), unless a
    folder changed in the last ``RACY_NS``."""
    key = (str(root), tuple(extensions))
    if key in _WALKS:
        walk, stamps = _WALKS[key]
        try:
            if all(os.stat(folder).st_mtime_ns == mtime for folder, mtime in stamps.items()):
                return walk
        except OSError:
            pass
    found, exts = [], tuple(e.lower() for e in extensions)
    seen: Counter[str] = Counter()  # files by extension
    top = str(root)
    folders, stamps = [top], {}
    while folders:
        folder = folders.pop()
        stamps[folder] = os.stat(folder).st_mtime_ns
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.is_dir():
                    if entry.name not in SKIP_DIRS and not entry.name.startswith("."):
                        folders.append(entry.path)
                    continue
                name = entry.name.lower()
                seen[os.path.splitext(name)[1] or "(none)"] += 1
                if name.endswith(exts) and entry.is_file() and (stat := entry.stat()).st_size > 0:
                    relative = entry.path[len(top) :].lstrip(os.sep).replace(os.sep, "/")
                    found.append((relative, entry.path, (stat.st_dev, stat.st_ino)))
    found.sort(key=lambda f: f[0].split("/"))  # (the order of Path: folder by folder)
    walk = ([(relative, Path(full), file_id) for relative, full, file_id in found], seen)
    if time.time_ns() - max(stamps.values()) > RACY_NS:  # (a folder changed just now may change again in its tick)
        _WALKS[key] = (walk, stamps)
    return walk


def discover(paths: list[str] | None, extensions: list[str]) -> tuple[list[tuple[str, Path]], list[str]]:
    """``(key, path)`` of every document, and the problems found (each ends with its fix).

    Keys are relative paths: inside the standard library as they are, inside a folder prefixed by
    the folder's name, a file by its name. Files named directly are taken whatever their suffix.
    Kept for the process while every folder's walk is kept (``_walk``) and every file named directly is
    unchanged: a start validates the config 3 times, then reads the documents.
    """
    key = (None if paths is None else tuple(paths), tuple(extensions))
    seen = _signature(paths, extensions)
    if key in _FOUND and len(_FOUND[key][0]) == len(seen) and all(map(_same, _FOUND[key][0], seen)):
        return _FOUND[key][1]
    found = _discover(paths, extensions, seen)
    _FOUND[key] = (seen, found)
    return found


#: ``discover``'s results of this process: (paths, extensions) -> (``_signature``, result).
_FOUND: dict[tuple[Any, ...], tuple[list[Any], Any]] = {}


def _signature(paths: list[str] | None, extensions: list[str]) -> list[Any]:
    """What ``discover``'s result depends on: each folder's walk (the same object while it is kept: a list,
    compared by identity) and each file's (size, mtime, inode); None for a path that does not exist."""
    out: list[Any] = []
    for raw in [str(stdlib_root())] if paths is None else paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            out.append([_walk(path, extensions)])
        elif path.exists():
            stat = path.stat()
            out.append((stat.st_size, stat.st_mtime_ns, stat.st_ino))
        else:
            out.append(None)
    return out


def _same(a: Any, b: Any) -> bool:
    return a[0] is b[0] if isinstance(a, list) and isinstance(b, list) else a == b


def _discover(
    paths: list[str] | None, extensions: list[str], seen: list[Any]
) -> tuple[list[tuple[str, Path]], list[str]]:
    """``discover``'s result; ``seen``: its ``_signature``, whose walks it uses (a folder is walked once)."""
    if paths is None:
        root = stdlib_root()
        files, _ = seen[0][0]
        problem = f"the standard library at {root} has no file ending in {extensions}. Fix: set data.paths."
        return [(relative, path) for relative, path, _ in files], [] if files else [problem]
    docs, problems = [], [] if paths else ["paths is an empty list. Fix: name files or folders, or paths=null."]
    ids = []  # (device, inode) of each document: a file reached twice is one file
    for i, raw in enumerate(paths):
        path = Path(raw).expanduser()
        where = f"paths[{i}]={raw!r}"
        if not path.exists():
            problems.append(
                f"{where} does not exist. Fix: pass an existing file or folder, or paths=null for the "
                "built-in standard library corpus."
            )
        elif path.is_file():
            if (stat := path.stat()).st_size == 0:
                problems.append(f"{where} is an empty file. Fix: remove it from data.paths.")
            docs.append((path.name, path))
            ids.append((stat.st_dev, stat.st_ino))
        else:
            files, suffixes = seen[i][0] if isinstance(seen[i], list) else _walk(path, extensions)
            if not files and not suffixes:
                problems.append(f"{where} is an empty folder. Fix: put text files in it or pass another folder.")
            elif not files:
                common = ", ".join(f"{ext} ({n})" for ext, n in suffixes.most_common(8))
                top = suffixes.most_common(1)[0][0]
                problems.append(
                    f"{where} has no non-empty file ending in {extensions} (found: {common}). Fix: set "
                    f"data.extensions to the suffixes of your text files, e.g. extensions=['{top}']."
                )
            docs += [(f"{path.name}/{relative}", file) for relative, file, _ in files]
            ids += [file_id for *_, file_id in files]
    first: dict[tuple[int, int], str] = {}  # (device, inode) of a file -> its first key (a link is the same file)
    twice = []
    for (key, _), real in zip(docs, ids):
        if real in first:
            twice.append((first[real], key))
        else:
            first[real] = key
    if twice:  # one file under two keys: read twice, and the split hash could put it in two splits
        (a, b), more = twice[0], f" and {len(twice) - 1} more" if len(twice) > 1 else ""
        problems.append(
            f"data.paths reach the same file twice: {a} is also {b}{more} (a folder and a folder or file inside "
            "it?). It would be read twice and could land in two splits. Fix: name each file once in data.paths."
        )
    return docs, problems


def not_text(data: bytes) -> str | None:
    """``"binary"`` when ``data`` holds a NUL byte, ``"not UTF-8"`` when it does not decode, else None."""
    if b"\0" in data:
        return "binary"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return "not UTF-8"
    return None


class FileFacts:
    """Size, SHA-256 and ``not_text`` of files, remembered by ``(size, mtime_ns, inode)`` in a JSON file.

    Hashing every file on every start made start-up grow with the corpus (~3 s per GB); a file whose size,
    modification time and inode are unchanged is taken as unchanged (as ``make`` and ``git`` do), and its facts
    are not read again. A change that keeps all three is not seen; the documents are still checked against
    the hashes whenever they are read (``_read_documents``).
    """

    def __init__(self, path: Path):
        self.path, self.changed = path, False  # (files modified in the last RACY_NS are never remembered)
        self.known: dict[str, list] = {}
        if path.exists():
            try:
                self.known = dict(json.loads(path.read_text()))
            except (OSError, ValueError, TypeError) as err:
                log.warning("data cache %s cannot be read (%s); hashing the files again", path, err)

    def of(self, file: Path) -> tuple[int, str, str | None]:
        """``(bytes, sha256, not_text(data))`` of ``file``."""
        stat = file.stat()
        stamp = [stat.st_size, stat.st_mtime_ns, stat.st_ino]
        entry = self.known.get(str(file))
        if entry is not None and entry[:3] == stamp:
            return stat.st_size, entry[3], entry[4]
        data = file.read_bytes()
        facts = (len(data), hashlib.sha256(data).hexdigest(), not_text(data))
        if time.time_ns() - stat.st_mtime_ns > RACY_NS:  # (a file written just now may change again in its tick)
            self.known[str(file)], self.changed = [*stamp, facts[1], facts[2]], True
        return facts

    def save(self) -> None:
        if self.changed:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.known))
            os.replace(tmp, self.path)
