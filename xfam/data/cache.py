"""The data caches: named by a key of everything that changes their contents, checked when loaded,
rebuilt with a warning when they cannot be used.

Every cached stage of a source lives under ``cache_root()`` (``<datasets cache>/xfam``):

* ``lm/<stage>-<key>.arrow``: a ``datasets.map`` output (token ids, packed rows) of ``data=text/hf``;
* ``generated/<key>/``: a ``Dataset.from_generator`` output (the documents of ``data=text``, every
  split of a synthetic task), one folder per key so a bad one is removed whole;
* ``tokenizers/bpe-<corpus>-<vocab>.json``: a trained BPE (``xfam.data.tokenize``).

A key is a hash of the inputs of the stage (file contents, tokenizer, generator parameters, seed,
``seq_len``, the stored format), so a change to any of them names another file and a stale cache is
never read. A file that exists but cannot be used (a crash mid-copy, a truncated or foreign file,
fewer rows than the stage makes, ids outside the vocabulary) is deleted and rebuilt, with a
warning; a freshly built one that fails its check is a bug and raises.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from xfam.data.tokenize import cache_root
from xfam.errors import ConfigError
from xfam.logs import log

#: A check of a loaded stage: None when usable, else what is wrong with it.
Check = Callable[[Any], "str | None"]
#: What reading a damaged cache raises: Arrow (truncated IPC), the OS, json (a cut dataset_info.json).
UNREADABLE = (pa.ArrowException, OSError, ValueError)


def max_id(ds: Any, column: str) -> int:
    """Largest token id in a list column (-1 when empty), computed by Arrow without Python loops."""
    values = ds.with_format("arrow")[column].combine_chunks().flatten()
    return -1 if len(values) == 0 else int(pc.max(values).as_py())


def rows_check(rows: int, column: str | None = None, vocab_size: int | None = None) -> Check:
    """A check that a stage holds exactly ``rows`` rows and, given ``column``, ids below ``vocab_size``."""

    def check(ds: Any) -> str | None:
        if len(ds) != rows:
            return f"{len(ds)} rows where this stage makes {rows}"
        if column is not None and vocab_size is not None and (top := max_id(ds, column)) >= vocab_size:
            return f"token id {top} >= vocab_size {vocab_size}"
        return None

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

    cached = folder.is_dir() and any(folder.rglob("dataset_info.json"))  # lock files alone: nothing was built
    return _rebuild(build, check, folder, cached, lambda: shutil.rmtree(folder, ignore_errors=True))
