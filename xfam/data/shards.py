"""Token shards: a split's token stream written once, in parallel, and memory-mapped at training time.

The approach of nanoGPT's prepare step (ids written once to a flat file, rows read from it as windows),
cut into shards so that preparation runs on every core and an interrupted one continues. One split lives
in its own folder under ``cache_root()/shards/<key>/<split>/``:

* ``shard-00000.bin``: the ids of a run of consecutive documents, each followed by ``eos`` (when the
  source joins documents with it), raw little-endian ``uint16`` (``uint32`` past 65,536 ids);
* ``shard-00000.json``: its record: the documents ``[start, end)`` it holds, their text bytes, its
  token count, the smallest and largest id, and the ``.bin`` file's size and modification time;
* ``index.json``: the seal, written last: the records of every shard in order. A folder without it
  is an unfinished preparation; training reads sealed folders only.

**Resumable.** The documents of each shard are fixed before any work (``plan``: consecutive documents
until ~``SHARD_BYTES`` of text), so an interrupted preparation redoes only the shards without a
record. A ``.bin`` and its record are each written under a temporary name and renamed into place, the
record after the ``.bin``: a killed writer leaves a temporary file (removed at the next start), never a
shard that training would read half-written.

**Parallel.** ``num_proc`` worker processes (forked: they inherit the documents, memory-mapped by
``datasets``, and the tokenizer) each write whole shards; every process encodes on one thread
(``TOKENIZERS_PARALLELISM=false``), so ``num_proc`` is the number of cores used. Memory stays bounded:
a worker holds one batch of documents and their ids at a time, whatever the corpus size.

**Checked in constant time.** On load each shard's size and modification time must equal its record
(a truncated, replaced or rewritten shard is rebuilt, with a warning); an id outside the vocabulary is
caught when the shard is written (its record's min/max). Hashing every shard on every start would make
start-up grow with the corpus; a shard changed in place with its size and mtime restored is not seen.

``TokenStream`` is one split's stream over its shards (``np.memmap``, opened lazily, so a pickled
stream, e.g. into a spawned rank, carries paths, not tokens); ``PackedRows`` cuts it into rows of
``seq_len + 1`` tokens with stride ``seq_len`` (``xfam.data.packing``) without materialising them.

One file over 400 lines: writing, checking and reading shards share one on-disk format and are read together.
"""

from __future__ import annotations

import bisect
import json
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import Progress, TextColumn, TransferSpeedColumn

from xfam.core.errors import ConfigError
from xfam.core.logs import log

#: Text per shard (bytes): enough shards for every core on a few-MB corpus, few files at a GB.
SHARD_BYTES = 16 * 2**20
#: Enters the folder key: bump it when the stored form of shards changes.
SHARD_FORMAT = 1
INDEX = "index.json"
#: Documents read and encoded at a time by one process (bounds its memory).
DOC_BATCH = 256


def pack_rows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """``[n, seq_len + 1]`` rows of a token stream, stride ``seq_len``; ``n = (len - 1) // seq_len``."""
    n = max(0, (len(stream) - 1) // seq_len)
    if n == 0:
        return np.zeros((0, seq_len + 1), dtype=stream.dtype)
    windows = np.lib.stride_tricks.sliding_window_view(stream, seq_len + 1)  # [len - S, S + 1], a view
    return np.ascontiguousarray(windows[::seq_len][:n])


def plan(text_bytes: Sequence[int] | np.ndarray, shard_bytes: int | None = None) -> list[tuple[int, int]]:
    """``[start, end)`` document ranges of the shards: consecutive documents until ``shard_bytes`` of text."""
    ranges, start, size, shard_bytes = [], 0, 0, shard_bytes or SHARD_BYTES
    for i, n in enumerate(text_bytes):
        size += int(n)
        if size >= shard_bytes:
            ranges.append((start, i + 1))
            start, size = i + 1, 0
    if start < len(text_bytes) or not ranges:
        ranges.append((start, len(text_bytes)))
    return ranges


@dataclass
class Job:
    """One shard to write: documents ``[start, end)`` of split ``split`` into ``folder/shard-<index>``."""

    split: str
    index: int
    start: int
    end: int
    folder: Path
    text_bytes: int  # of its documents (``doc_bytes``: from Arrow's offsets, no text decoded)

    @property
    def bin(self) -> Path:
        return self.folder / f"shard-{self.index:05d}.bin"

    @property
    def record(self) -> Path:
        return self.folder / f"shard-{self.index:05d}.json"


class Encoder:
    """What a worker needs to write shards: the documents of every split, their text column, the tokenizer."""

    def __init__(self, docs: dict[str, Any], column: str, tokenizer: Any, eos_id: int | None, dtype: str):
        self.docs, self.column, self.tokenizer, self.eos_id, self.dtype = docs, column, tokenizer, eos_id, dtype

    def batches(self, split: str, start: int, end: int) -> Iterator[list[Any]]:
        """The non-empty documents ``[start, end)`` of ``split``, ``DOC_BATCH`` at a time (str or bytes)."""
        table = self.docs[split].with_format("arrow")
        for a in range(start, end, DOC_BATCH):
            yield [d for d in table[a : min(a + DOC_BATCH, end)].column(self.column).to_pylist() if d]

    def write(self, job: Job) -> dict[str, Any]:
        """Encode the job's documents into its ``.bin`` and record (each renamed into place when complete)."""
        tmp = job.bin.with_suffix(f".bin.{os.getpid()}.tmp")
        docs = tokens = 0
        low, high = None, None
        eos = None if self.eos_id is None else np.array([self.eos_id], dtype=self.dtype)
        with open(tmp, "wb") as f:
            for batch in self.batches(job.split, job.start, job.end):
                arrays = [a.astype(self.dtype, copy=False) for a in self.tokenizer.encode_docs(batch)]
                if eos is not None:
                    arrays = [piece for a in arrays for piece in (a, eos)]
                ids = np.concatenate(arrays) if arrays else np.zeros(0, dtype=self.dtype)
                if len(ids):
                    low = int(ids.min()) if low is None else min(low, int(ids.min()))
                    high = int(ids.max()) if high is None else max(high, int(ids.max()))
                f.write(ids.astype(np.dtype(self.dtype).newbyteorder("<"), copy=False).tobytes())
                docs += len(batch)
                tokens += len(ids)
        os.replace(tmp, job.bin)
        stat = job.bin.stat()
        record = {
            "file": job.bin.name,
            "documents": [job.start, job.end],
            "non_empty": docs,
            "text_bytes": job.text_bytes,
            "tokens": tokens,
            "min_id": low,
            "max_id": high,
            "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
        }
        write_json(job.record, record)
        return record


def write_json(path: Path, data: Any) -> None:
    """``data`` as JSON at ``path``, renamed into place when complete."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


#: The encoder forked workers inherit (set just before the pool starts; fork copies it, nothing is pickled).
_ENCODER: Encoder | None = None


def _init_worker() -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per process: num_proc is the cores used


def _run(job: Job) -> tuple[Job, dict[str, Any]]:
    assert _ENCODER is not None
    return job, _ENCODER.write(job)


@contextmanager
def _one_thread() -> Iterator[None]:
    """Encoding in this process on one thread (``tokenizers`` reads the variable at every call)."""
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a batch scheduler sets), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # (not Linux)
        return max(1, os.cpu_count() or 1)


def run_jobs(
    encoder: Encoder, jobs: list[Job], num_proc: int, total_bytes: int, desc: str, on_done: Callable[[Job, dict], None]
) -> None:
    """Write every job's shard on ``num_proc`` processes (this one when 1), with a progress bar in text bytes."""
    global _ENCODER
    procs = max(1, min(num_proc, len(jobs)))
    start, tokens = time.perf_counter(), 0
    columns = (*Progress.get_default_columns()[:-1], TransferSpeedColumn(), TextColumn("{task.fields[rate]}"))
    console = Console(stderr=True)  # (a batch job's log gets the summary line below, not a redrawn bar)
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task(desc, total=total_bytes, rate="")

        def done(job: Job, record: dict[str, Any]) -> None:
            nonlocal tokens
            tokens += record["tokens"]
            on_done(job, record)
            rate = f"{tokens / max(time.perf_counter() - start, 1e-9) / 1e6:.2f} M tokens/s"
            bar.update(task, advance=record["text_bytes"], rate=rate)

        if procs == 1:
            with _one_thread():
                for job in jobs:
                    done(job, encoder.write(job))
        else:
            _ENCODER = encoder
            try:
                with multiprocessing.get_context("fork").Pool(procs, initializer=_init_worker) as pool:
                    for job, record in pool.imap_unordered(_run, jobs):
                        done(job, record)
            finally:
                _ENCODER = None
    seconds = time.perf_counter() - start
    if jobs:
        mb = total_bytes / 1e6
        log.info(
            "%s: %s, %.1f MB of text, %.2f M tokens in %.1f s on %d process%s (%.1f MB/s, %.2f M tokens/s)",
            desc,
            f"{len(jobs)} shard" + "s" * (len(jobs) > 1),
            mb,
            tokens / 1e6,
            seconds,
            procs,
            "es" if procs > 1 else "",
            mb / max(seconds, 1e-9),
            tokens / 1e6 / max(seconds, 1e-9),
        )


def _record_ok(folder: Path, record: dict[str, Any]) -> str | None:
    """None when the shard of ``record`` is on disk as it was written, else what differs."""
    path = folder / record["file"]
    try:
        stat = path.stat()
    except FileNotFoundError:
        return f"{path.name} is missing"
    if stat.st_size != record["size"]:
        return f"{path.name} holds {stat.st_size} bytes where {record['size']} were written"
    if stat.st_mtime_ns != record["mtime_ns"]:
        return f"{path.name} was modified after it was written"
    return None


def readable(path: Path) -> None:
    """Refuse a shard this process cannot read (permissions, an unreadable disk): it cannot be rebuilt either."""
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as err:
        raise ConfigError(
            f"token shard {path} cannot be read ({type(err).__name__}: {err}). Fix: make it readable, or delete "
            f"the folder {path.parent.parent} so that it is prepared again."
        ) from err


def prepare_split(
    encoder: Encoder,
    split: str,
    folder: Path,
    text_bytes: Sequence[int] | np.ndarray,
    num_proc: int,
    desc: str,
    vocab_size: int,
) -> dict[str, Any]:
    """The sealed index of one split's shards in ``folder``: loaded when sealed and intact, else written
    (only the shards that are missing or damaged; the others are kept)."""
    folder.mkdir(parents=True, exist_ok=True)
    ranges = plan(text_bytes)
    index_path = folder / INDEX
    records: dict[int, dict[str, Any]] = {}
    if index_path.exists():
        try:
            index = json.loads(index_path.read_text())
            records = dict(enumerate(index["shards"]))  # (a record of another plan is dropped below)
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.warning("token shard index %s cannot be read (%s); checking its shards again", index_path, err)
    else:
        for path in folder.glob("shard-*.json"):  # an interrupted preparation: keep the shards it finished
            try:
                record = json.loads(path.read_text())
                records[int(path.stem.split("-")[1])] = record
            except (OSError, ValueError, IndexError) as err:
                log.warning("token shard record %s cannot be read (%s); writing that shard again", path, err)
    for tmp in folder.glob("*.tmp"):  # left by a killed writer
        tmp.unlink(missing_ok=True)
    damaged = []
    for i, record in list(records.items()):
        start, end = record.get("documents", [None, None])
        problem = _record_ok(folder, record) if i < len(ranges) and (start, end) == ranges[i] else "another plan"
        if problem is not None:
            damaged.append(f"{record.get('file', i)}: {problem}")
            del records[i]
    if damaged and index_path.exists():
        log.warning("token shards in %s cannot be read (%s); writing them again", folder, "; ".join(damaged[:3]))
    sizes = np.asarray(text_bytes, dtype=np.int64)
    jobs = [Job(split, i, a, b, folder, int(sizes[a:b].sum())) for i, (a, b) in enumerate(ranges) if i not in records]
    if jobs:
        index_path.unlink(missing_ok=True)  # unsealed until every shard is back
        if records:
            log.info("%s: continuing a preparation: %d of %d shards done", desc, len(records), len(ranges))
        total = sum(job.text_bytes for job in jobs)
        run_jobs(encoder, jobs, num_proc, total, desc, lambda job, record: records.__setitem__(job.index, record))
    shards = [records[i] for i in range(len(ranges))]
    for record in shards:
        if record["max_id"] is not None and (record["min_id"] < 0 or record["max_id"] >= vocab_size):
            raise RuntimeError(
                f"xfam bug: shard {folder / record['file']} holds ids {record['min_id']}..{record['max_id']}, outside "
                f"the vocabulary of {vocab_size}"
            )
        readable(folder / record["file"])
    index = {
        "format": SHARD_FORMAT,
        "dtype": encoder.dtype,
        "vocab_size": vocab_size,
        "ranges": [list(r) for r in ranges],
        "shards": shards,
    }
    if jobs or not index_path.exists():
        write_json(index_path, index)
    else:
        tokens, dtype = sum(r["tokens"] for r in shards) / 1e6, encoder.dtype
        log.info("%s: prepared already: %d shards, %.2f M %s ids in %s", desc, len(shards), tokens, dtype, folder)
    return index


class TokenStream:
    """One split's token stream over its shards: ``len`` ids, ``stream[a:b]`` an array (memory-mapped reads)."""

    def __init__(self, folder: Path, index: dict[str, Any]):
        self.folder = folder
        self.dtype = np.dtype(index["dtype"]).newbyteorder("<")
        self.files = [r["file"] for r in index["shards"] if r["tokens"] > 0]
        self.counts = [r["tokens"] for r in index["shards"] if r["tokens"] > 0]
        self.starts = np.cumsum([0, *self.counts]).tolist()  # stream offset of each shard
        self._maps: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return self.starts[-1]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": None}  # paths travel, tokens do not (reopened lazily)

    def maps(self) -> list[np.ndarray]:
        if self._maps is None:
            self._maps = [
                np.memmap(self.folder / f, dtype=self.dtype, mode="r", shape=(n,))
                for f, n in zip(self.files, self.counts)
            ]
        return self._maps

    def __getitem__(self, span: slice) -> np.ndarray:
        """Ids ``[a, b)`` of the stream (a copy, concatenated across shards where the span crosses one)."""
        a, b, _ = span.indices(len(self))
        maps, pieces = self.maps(), []
        k = bisect.bisect_right(self.starts, a) - 1
        while a < b:
            lo, hi = a - self.starts[k], min(b, self.starts[k + 1]) - self.starts[k]
            pieces.append(maps[k][lo:hi])
            a, k = self.starts[k] + hi, k + 1
        return np.concatenate(pieces) if len(pieces) != 1 else np.array(pieces[0])

    def pieces(self) -> Iterator[np.ndarray]:
        """The shards' arrays in order (memory-mapped, not copied)."""
        yield from self.maps()


class ArrayStream:
    """A token stream held in memory (a streamed source's evaluation rows), read like a ``TokenStream``."""

    def __init__(self, ids: np.ndarray):
        self.ids, self.dtype = ids, ids.dtype

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, span: slice) -> np.ndarray:
        return np.array(self.ids[span])

    def pieces(self) -> Iterator[np.ndarray]:
        yield self.ids


class PackedRows(torch.utils.data.Dataset):
    """Rows of ``seq_len + 1`` tokens with stride ``seq_len`` over a ``TokenStream``, read on demand.

    ``rows[i]`` is ``{"tokens": int64 [S + 1]}``, as a ``datasets`` row formatted for torch;
    ``rows[i:j]`` / ``rows["tokens"]`` give ``{"tokens": [n, S + 1]}`` / the ``[n, S + 1]`` tensor (copies:
    meant for evaluation splits). The DataLoader fetches a batch with one call (``__getitems__``).
    """

    def __init__(self, stream: TokenStream | ArrayStream, seq_len: int):
        self.stream, self.seq_len = stream, seq_len
        self.num_rows = max(0, (len(stream) - 1) // seq_len)

    def __len__(self) -> int:
        return self.num_rows

    def row(self, i: int) -> np.ndarray:
        if not -self.num_rows <= i < self.num_rows:
            raise IndexError(f"row {i} of {self.num_rows}")
        i %= self.num_rows
        return self.stream[i * self.seq_len : i * self.seq_len + self.seq_len + 1]

    def block(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` as one ``[n, S + 1]`` array (consecutive rows share a token)."""
        s = self.seq_len
        return pack_rows(self.stream[start * s : max(start, stop) * s + 1], s)

    def __getitem__(self, key: int | slice | str) -> Any:
        if isinstance(key, str):
            if key != "tokens":
                raise KeyError(f"rows have one column, 'tokens', not {key!r}")
            return torch.from_numpy(self.block(0, self.num_rows).astype(np.int64))
        if isinstance(key, slice):
            start, stop, step = key.indices(self.num_rows)
            if step == 1:
                block = self.block(start, max(start, stop))
            else:
                rows = [self.row(i) for i in range(start, stop, step)]
                block = np.stack(rows) if rows else self.block(0, 0)
            return {"tokens": torch.from_numpy(block.astype(np.int64))}
        return {"tokens": torch.from_numpy(self.row(int(key)).astype(np.int64))}

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        return [{"tokens": torch.from_numpy(self.row(int(i)).astype(np.int64))} for i in indices]

    def targets(self) -> Iterator[np.ndarray]:
        """Every target token of the rows once (``stream[1 : 1 + rows * S]``), in shard-sized pieces."""
        end, offset = 1 + self.num_rows * self.seq_len, 0
        for piece in self.stream.pieces():
            lo, hi = max(1, offset) - offset, min(end, offset + len(piece)) - offset
            if hi > lo:
                yield piece[lo:hi]
            offset += len(piece)
