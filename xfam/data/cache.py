"""The data caches: named by a key of everything that changes their contents, checked when loaded,
rebuilt with a warning when they cannot be used.

Every cached stage of a source lives under ``cache_root()`` (``<datasets cache>/xfam``):

* ``shards/<key>/<split>/``: the token shards of ``data=text/hf`` (``xfam.data.shards``, which checks
  and rebuilds them itself: per shard, in constant time);
* ``lm/<stage>-<key>.arrow``: a ``datasets.map`` output (the ids of ``data=hf``'s pairs, cut pairs);
* ``generated/<key>/``: a ``Dataset.from_generator`` output (the documents of ``data=text``, every
  split of a synthetic task), one folder per key so a bad one is removed whole;
* ``tokenizers/bpe-<corpus>-<vocab>.json``: a trained BPE (``xfam.data.tokenize``);
* ``text-files/<key>.json``: the size, hash and text check of ``data=text``'s files (``FileFacts``).

A key is a hash of the inputs of the stage (file contents, tokenizer, generator parameters, seed,
``seq_len``, the stored format), so a change to any of them names another file and a stale cache is
never read. A file that exists but cannot be used (a crash mid-copy, a truncated or foreign file,
fewer rows than the stage makes, ids outside the vocabulary at either end, a row of another length:
``rows_check``) is deleted and rebuilt, with a warning; a freshly built one that fails its check is
a bug and raises. The checks run on every load, in Arrow over the memory-mapped file without a copy
(each id read once, row lengths from the list offsets).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from xfam.core.errors import ConfigError
from xfam.core.logs import log
from xfam.data.tokenize import cache_root

#: A check of a loaded stage: None when usable, else what is wrong with it.
Check = Callable[[Any], "str | None"]
#: What reading a damaged cache raises: Arrow (truncated IPC), the OS, json (a cut dataset_info.json).
UNREADABLE = (pa.ArrowException, OSError, ValueError)


def ids_problem(ds: Any, column: str, vocab_size: int | None = None, length: int | None = None) -> str | None:
    """What makes ``column`` of ``ds`` unusable as token ids, or None: a missing column, a layout other
    than lists of integers, nulls, a row whose length is not ``length``, an id outside
    ``0 .. vocab_size - 1`` (both ends: a negative id indexes from the end, a large one past it).

    Computed by Arrow on the memory-mapped column without Python loops or a copy: the lengths come
    from the list offsets, and the ids are read once (``min_max``). A column of integers (a class
    label) is checked the same way, as rows of one value.
    """
    if column not in ds.column_names:
        return f"no column {column!r} (it has {ds.column_names})"
    col = ds.with_format("arrow")[column]
    kind = col.type
    is_list = pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
    values = pc.list_flatten(col) if is_list else col
    if not pa.types.is_integer(values.type):
        return f"column {column!r} is {kind}, not {'lists of ' * is_list}integer ids"
    if col.null_count or values.null_count:
        return f"column {column!r} holds {col.null_count + values.null_count} nulls"
    if length is not None and is_list and len(col):
        shortest, longest = pc.min_max(pc.list_value_length(col)).values()
        if (shortest.as_py(), longest.as_py()) != (length, length):
            return f"rows of {shortest} to {longest} tokens in {column!r} where this stage makes {length}"
    if vocab_size is not None and len(values):
        low, high = (v.as_py() for v in pc.min_max(values).values())
        if low < 0 or high >= vocab_size:
            return f"ids {low} to {high} in {column!r}, outside 0 to {vocab_size - 1} (vocab_size {vocab_size})"
    return None


def rows_check(
    rows: int,
    column: str | None = None,
    vocab_size: int | None = None,
    length: int | None = None,
    labels: tuple[str, int] | None = None,
) -> Check:
    """A check that a stage holds exactly ``rows`` rows and, given ``column``, usable token ids there
    (``ids_problem``: ids in ``0 .. vocab_size - 1``, every row ``length`` long when given); ``labels``
    = ``(column, num_classes)``: class labels in ``0 .. num_classes - 1``."""

    def check(ds: Any) -> str | None:
        if len(ds) != rows:
            return f"{len(ds)} rows where this stage makes {rows}"
        if column is not None and (problem := ids_problem(ds, column, vocab_size, length)):
            return problem
        return None if labels is None else ids_problem(ds, *labels)

    return check


def _rebuild(build: Callable[[], Any], check: Check, path: Path, cached: bool, remove: Callable[[], None]) -> Any:
    """``build()`` (which loads the cache at ``path`` when ``cached``), rebuilt once if that cannot be used."""
    try:
        ds = build()
        problem = check(ds)
    except UNREADABLE as err:
        if not cached or isinstance(err, ConfigError):  # a problem of the input, not of the cache
            raise
        problem = f"{type(err).__name__}: {err}"
    if problem is None:
        return ds
    if not cached:
        raise RuntimeError(f"xfam bug: freshly built data cache {path} fails its check: {problem}")
    log.warning("data cache %s cannot be read (%s); rebuilding it", path, problem)
    remove()
    ds = build()
    if (problem := check(ds)) is not None:
        raise RuntimeError(f"xfam bug: rebuilt data cache {path} fails its check: {problem}")
    return ds


def cached_map(ds: Any, fn: Callable[[pa.Table], pa.Table], key: str, batch_size: int, check: Check, desc: str) -> Any:
    """``fn`` over ``ds`` in batches (Arrow tables in and out), cached in ``<cache_root>/lm/<key>.arrow``."""
    path = cache_root() / "lm" / f"{key}.arrow"
    path.parent.mkdir(parents=True, exist_ok=True)

    def build() -> Any:
        return ds.with_format("arrow").map(
            fn,
            batched=True,
            batch_size=batch_size,
            remove_columns=ds.column_names,
            new_fingerprint=key,
            cache_file_name=str(path),
            desc=desc,
        )

    return _rebuild(build, check, path, path.exists(), lambda: path.unlink(missing_ok=True))


def cached_generate(
    generator: Callable[..., Any], gen_kwargs: dict[str, Any], features: Any, split: str, key: str, check: Check
) -> Any:
    """``Dataset.from_generator`` of one split, cached in its own folder ``<cache_root>/generated/<key>/``."""
    from datasets import Dataset

    folder = cache_root() / "generated" / key

    def build() -> Any:
        return Dataset.from_generator(
            generator, features=features, gen_kwargs=gen_kwargs, split=split, fingerprint=key, cache_dir=str(folder)
        )

    def full_check(ds: Any) -> str | None:  # the stored layout first: a foreign file may hold other columns
        return f"features {ds.features} where this stage makes {features}" if ds.features != features else check(ds)

    cached = folder.is_dir() and any(folder.rglob("dataset_info.json"))  # lock files alone: nothing was built
    return _rebuild(build, full_check, folder, cached, lambda: shutil.rmtree(folder, ignore_errors=True))
