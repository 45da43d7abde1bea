"""Streamed corpora (``data=hf data.streaming=true``): documents read lazily, tokenised in the loader workers.

For corpora too large to prepare (a FineWeb sample, a many-GB folder of JSON lines), nothing is written
before training: ``datasets`` streams the split (``load_dataset(..., streaming=True)``: a hub dataset, a
local folder of data files, or a ``save_to_disk`` folder through ``to_iterable_dataset``), and each loader
worker tokenises its documents and packs them into rows as ``data=text`` does (documents joined by eos,
rows of ``seq_len + 1`` tokens with stride ``seq_len``), batch by batch.

**Units.** Rank r's loader worker w reads unit ``u = r * W + (w + rotation) % W`` of ``U = ranks x W``
(``W = max(1, loader.num_workers)``): ``datasets.distributed.split_dataset_by_node(stream, u, U)`` gives it
whole shards of the source when their count divides ``U``, else every U-th document. A unit packs its own
rows; the DataLoader takes batches from its workers in turn, so batch t of a rank comes from worker
``t mod W``. The order is fixed by the source, ``U`` and the seed, and it is not the order of the same data
prepared (``data.streaming=false``). A unit that reaches the end of its documents starts them again (the
stream's ``passes`` count in its state): the loader never ends, so every rank takes the same number of
steps, and training stops at ``trainer.max_steps``.

**Exact resume.** With every batch a worker sends its unit's position: the ``datasets`` state of the stream
before the document being packed (``IterableDataset.state_dict``: the shard and the example in it), how many
of that document's tokens are already in rows, the tokens of earlier documents not yet in a row, and the pass.
The data module keeps the position of the last batch each unit delivered to training, and checkpoints save
it; a resume loads each unit's position (re-reading from the start of the current shard, which ``datasets``
does) and rotates the workers so that the next batch comes from the unit whose turn it is. Resuming needs the
same ``U``: another number of processes or loader workers is refused before launch.

With ``data.shuffle_buffer > 0`` documents are shuffled by ``datasets`` (shard order and a buffer of that many
documents, seeded, reshuffled every pass). The buffer's contents are not part of a ``datasets`` state, so a
resume is approximate: the documents held in the buffer at the checkpoint are skipped. That is refused while
``data.exact_resume=true`` (the default).

**Evaluation splits** are small and held in memory: the first ``data.eval_rows`` rows of a named split's
stream; a split carved from train (``validation_split: null``) takes the documents of the train stream whose
text hashes into it (``carve``: a hash of the text, so the same under every ``U`` and every order) and the
training units skip them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from xfam.core.errors import ConfigError
from xfam.data.shards import pack_rows

#: Data files a local folder may hold for ``load_dataset(folder, streaming=True)``.
DATA_FILES = (".json", ".jsonl", ".parquet", ".csv", ".txt", ".arrow")


def carve(text: str | bytes, fractions: dict[str, float]) -> str:
    """The split a document of a carved stream belongs to: test, validation or train, by a hash of its text."""
    raw = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    u = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "big") / 2**64
    low = 0.0
    for name in ("test", "validation"):
        share = fractions.get(name, 0.0)
        if low <= u < low + share:
            return name
        low += share
    return "train"


def is_data_folder(folder: Path) -> bool:
    """A local folder ``datasets`` can stream by file type (JSON lines, Parquet, CSV, text, Arrow)."""
    return folder.is_dir() and any(p.suffix in DATA_FILES for p in folder.rglob("*") if p.is_file())


class Opener:
    """Opens one split's stream (picklable: loader workers and spawned ranks open their own)."""

    def __init__(self, path: str, config_name: str | None, split: str, shuffle_buffer: int, seed: int):
        self.path, self.config_name, self.split = path, config_name, split
        self.shuffle_buffer, self.seed = shuffle_buffer, seed

    def __call__(self, unit: int = 0, units: int = 1, epoch: int = 0) -> Any:
        import datasets
        from datasets.distributed import split_dataset_by_node

        local = Path(self.path).expanduser()
        if local.is_dir() and ((local / "dataset_dict.json").is_file() or (local / "state.json").is_file()):
            loaded = datasets.load_from_disk(str(local))
            table = loaded if isinstance(loaded, datasets.Dataset) else loaded[self.split]
            stream = table.to_iterable_dataset(num_shards=max(1, min(64, len(table))))
        elif local.is_dir():
            stream = datasets.load_dataset(str(local), split=self.split, streaming=True)
        else:
            stream = datasets.load_dataset(self.path, self.config_name, split=self.split, streaming=True)
        if self.shuffle_buffer:
            stream = stream.shuffle(seed=self.seed, buffer_size=self.shuffle_buffer)
            stream.set_epoch(epoch)
        return split_dataset_by_node(stream, rank=unit, world_size=units) if units > 1 else stream


def documents(stream: Any, column: str) -> Iterator[Any]:
    """The ``column`` of each example, in order. (``IterableDataset.iter``: iterating the stream itself inside a
    loader worker would let ``datasets`` split its shards over the workers again, under the unit's split.)"""
    for batch in stream.iter(batch_size=1):
        yield batch[column][0]


class Packer:
    """Documents -> rows of ``S + 1`` tokens (stride ``S``), ``B`` rows at a time, with a resumable position."""

    def __init__(self, tokenizer: Any, eos_id: int | None, seq_len: int, batch_size: int):
        self.tokenizer, self.eos_id, self.seq_len, self.batch_size = tokenizer, eos_id, seq_len, batch_size

    def ids(self, text: str | bytes) -> np.ndarray:
        ids = np.asarray(self.tokenizer.encode_docs([text])[0], dtype=np.int64)
        return ids if self.eos_id is None else np.append(ids, self.eos_id)

    def batches(self, head: np.ndarray, doc: np.ndarray, pos: int) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
        """Batches ``[B, S + 1]`` from ``head`` (earlier tokens not yet in a row) then ``doc[pos:]``; each with the
        position after it: ``(head, pos)``. Consecutive rows share one token, as ``pack_rows``."""
        need, step = self.batch_size * self.seq_len + 1, self.batch_size * self.seq_len
        while len(head) + len(doc) - pos >= need:
            rows = pack_rows(np.concatenate([head, doc[pos : pos + need - len(head)]]), self.seq_len)  # [B, S + 1]
            if len(head) >= step:
                head = head[step:]
            else:
                pos, head = pos + step - len(head), head[:0]
            yield rows, head, pos


class StreamedTrain(torch.utils.data.IterableDataset):
    """This rank's training batches from a streamed split: ``(rows [B] of {"tokens": [S + 1]}, position)`` pairs.

    ``resume``: ``{unit: position}`` saved by a checkpoint, and ``rotation``: batches this rank consumed modulo
    its workers (which worker's unit comes next). See the module docstring.
    """

    def __init__(
        self,
        opener: Opener,
        column: str,
        packer: Packer,
        *,
        rank: int,
        world: int,
        fractions: dict[str, float] | None = None,
        resume: dict[int, dict[str, Any]] | None = None,
        rotation: int = 0,
    ):
        super().__init__()
        self.opener, self.column, self.packer = opener, column, packer
        self.rank, self.world, self.fractions = rank, world, fractions or {}
        self.resume, self.rotation = resume or {}, rotation

    def __iter__(self) -> Iterator[tuple[list[dict[str, torch.Tensor]], dict[str, Any]]]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        unit, units = self.rank * workers + (worker + self.rotation) % workers, self.world * workers
        state = self.resume.get(unit)
        passes = state["passes"] if state else 0
        head = np.asarray(state["head"], dtype=np.int64) if state else np.zeros(0, dtype=np.int64)
        pos, hf_state = (state["pos"], state["hf"]) if state else (0, None)
        while True:
            stream, found = self.opener(unit, units, passes), False
            if hf_state is not None:
                stream.load_state_dict(hf_state)
            docs = documents(stream, self.column)
            while True:
                before = stream.state_dict()  # the position before the next document
                try:
                    text = next(docs)
                except StopIteration:
                    break
                if not text or (self.fractions and carve(text, self.fractions) != "train"):
                    continue
                found, doc = True, self.packer.ids(text)
                for rows, rest, at in self.packer.batches(head, doc, pos):
                    head, pos = rest, at  # the position after this batch
                    position = {"unit": unit, "passes": passes, "hf": before, "head": head.tolist(), "pos": pos}
                    yield [{"tokens": torch.from_numpy(r)} for r in rows], position
                head, pos = np.concatenate([head, doc[pos:]]), 0
            if not found and hf_state is None:
                raise ConfigError(
                    f"data=hf streaming: unit {unit} of {units} (rank {self.rank}, loader worker {worker}) has no "
                    f"training text: the stream has fewer documents or shards than processes x loader workers. "
                    f"Fix: fewer loader.num_workers, or a larger corpus."
                )
            passes, hf_state = passes + 1, None


class StreamCollate:
    """Collate of a streamed batch (in the worker): the task's collate of its rows, plus the unit's position."""

    def __init__(self, collate: Any):
        self.collate = collate

    def __call__(self, item: tuple[list[dict[str, torch.Tensor]], dict[str, Any]]) -> dict[str, Any]:
        rows, position = item
        return {**self.collate(rows), POSITION: position}


#: The batch key carrying a streamed batch's position (removed by the data module before the model sees it).
POSITION = "stream_position"


def eval_tokens(
    opener: Opener, column: str, packer: Packer, rows: int, split: str, fractions: dict[str, float]
) -> np.ndarray:
    """The token stream of the first ``rows`` rows of an evaluation split (``fractions``: carved from train)."""
    need, pieces, total = rows * packer.seq_len + 1, [], 0
    for text in documents(opener(), column):
        if not text or (fractions and carve(text, fractions) != split):
            continue
        pieces.append(packer.ids(text))
        total += len(pieces[-1])
        if total >= need:
            break
    return np.concatenate(pieces)[:need] if pieces else np.zeros(0, dtype=np.int64)


class StreamedSplit:
    """A streamed train split: what the data module needs to build this rank's loader (``dataset``)."""

    def __init__(self, opener: Opener, column: str, packer: Packer, fractions: dict[str, float]):
        self.opener, self.column, self.packer, self.fractions = opener, column, packer, fractions

    def dataset(self, rank: int, world: int, resume: dict[int, dict] | None, rotation: int) -> StreamedTrain:
        return StreamedTrain(
            self.opener,
            self.column,
            self.packer,
            rank=rank,
            world=world,
            fractions=self.fractions,
            resume=resume,
            rotation=rotation,
        )
