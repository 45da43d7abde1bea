"""``data=hf``: language modelling on any Hugging Face dataset with a text column, or its text pairs.

``path`` is a hub id (``Salesforce/wikitext``, ``LTCB/enwik8``, ``deepmind/pg19`` ...), loaded with
``datasets.load_dataset`` (network, or the local hub cache), or a folder written by
``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``, loaded with ``load_from_disk``. Nothing
here touches the network unless ``path`` is a hub id; with ``HF_HUB_OFFLINE=1`` /
``HF_DATASETS_OFFLINE=1`` an uncached hub id fails at once, as a ``ConfigError`` with the fix.

A split named ``null`` is carved from train deterministically (a permutation seeded by ``seed``).
Tokenization and packing are those of ``data=text`` (``xfam.data.packing``); the fingerprint
combines the ``datasets`` fingerprints of the loaded splits with the carving, column, tokenizer
and ``seq_len``.

With ``source_column`` and ``target_column`` set the source is one of (source, target) text pairs
(``task = "seq2seq"``): constructing ``HFSource`` then makes an ``HFPairs``, whose behaviour lives in
``xfam.data.hf_pairs``; the loading and carving of the splits are the same.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np

from xfam.core.errors import ConfigError, unknown_choice
from xfam.core.registry import Range
from xfam.data.base import DATA, Task
from xfam.data.hf_pairs import PAIR_KEYS, PairsMixin, is_pairs, pair_problems
from xfam.data.packing import FORMAT, SPLITS, PackedLM, no_eos_message
from xfam.data.shards import ArrayStream, PackedRows
from xfam.data.streaming import Opener, Packer, StreamedSplit, eval_tokens, is_data_folder
from xfam.data.tokenize import build_tokenizer, short_hash, tokenizer_problems

_TEXT_TYPES = ("string", "large_string")


def _local_layout(folder: Path) -> dict[str, dict[str, Any]] | None:
    """``{split: features}`` of a ``save_to_disk`` folder, read from its JSON files (no data loaded)."""

    def features(d: Path) -> dict[str, Any]:
        return json.loads((d / "dataset_info.json").read_text()).get("features", {})

    if (folder / "dataset_dict.json").is_file():
        names = json.loads((folder / "dataset_dict.json").read_text())["splits"]
        return {n: features(folder / n) for n in names}
    if (folder / "state.json").is_file():
        return {"train": features(folder)}
    return None


def _split_problems(params: dict[str, Any], layout: dict[str, dict[str, Any]]) -> list[str]:
    """Problems with the split names and the text columns (``text_column``, or ``source_column`` and
    ``target_column`` of a source of pairs) of a dataset whose ``{split: features}`` is ``layout``."""
    problems = []
    for key in ("train_split", "validation_split", "test_split"):
        name = params[key]
        if name is not None and name not in layout:
            fix = f"set data.{key} to one of them" + ("" if key == "train_split" else " or null to carve it from train")
            problems.append(unknown_choice(f"{key} (a split name)", name, layout, fix + "."))
    lone_pair_column = not is_pairs(params) and any(params.get(k) is not None for k in PAIR_KEYS)  # pair_problems
    keys = () if lone_pair_column else PAIR_KEYS if is_pairs(params) else ("text_column",)
    columns = {k: params[k] for k in keys}
    for name, feats in layout.items():
        if name not in (params["train_split"], params["validation_split"], params["test_split"]):
            continue
        for key, column in columns.items():
            if column not in feats:
                where = f"{key} (a column of split {name!r})"
                problems.append(unknown_choice(where, column, feats, f"set data.{key} to one of the columns."))
            elif feats[column].get("_type") != "Value" or feats[column].get("dtype") not in _TEXT_TYPES:
                text = [c for c, f in feats.items() if f.get("_type") == "Value" and f.get("dtype") in _TEXT_TYPES]
                problems.append(
                    f"{key} {column!r} of split {name!r} is {feats[column]}, not text (the text columns are: "
                    f"{', '.join(text) or 'none'}). Fix: set data.{key} to a string column."
                )
    return problems


def _streaming_problems(params: dict[str, Any]) -> list[str]:
    """Settings that do not go with ``streaming`` (or need it)."""
    if not params["streaming"]:
        if params["shuffle_buffer"]:
            return [
                "shuffle_buffer shuffles a stream, and data.streaming=false. Fix: data.streaming=true, or remove it."
            ]
        return []
    problems = []
    if is_pairs(params):
        problems.append(
            "streaming=true reads language-modelling text; pairs (source_column, target_column) are prepared. "
            "Fix: data.streaming=false."
        )
    if params["tokenizer"] == "bpe":
        problems.append(
            "tokenizer=bpe is trained on the whole train split, which a stream never holds. Fix: data.tokenizer=byte, "
            "a pretrained tokenizer (data.tokenizer=<tokenizer.json or folder>), or data.streaming=false."
        )
    if params["shuffle_buffer"] and params["exact_resume"]:
        problems.append(
            f"shuffle_buffer={params['shuffle_buffer']} makes a resume approximate (the documents held in the buffer "
            "at a checkpoint are skipped: datasets does not save the buffer), and exact_resume=true demands an exact "
            "one. Fix: data.shuffle_buffer=0 (the source's order), or data.exact_resume=false to accept it."
        )
    return problems


@DATA.register("hf")
class HFSource(PackedLM):
    """Language modelling on a hub or ``save_to_disk`` dataset's text column, packed like ``data=text``.

    Args:
        path: hub id, or a local ``save_to_disk`` folder (a single ``Dataset`` counts as train).
        config_name: the hub configuration (null for none; ignored for a local folder).
        text_column: the column holding the text (language modelling).
        source_column / target_column: two text columns of (source, target) pairs: both set make a
            sequence-to-sequence source (``HFPairs``, see ``xfam.data.hf_pairs``); both null (default)
            the language-modelling source; one alone is refused.
        train_split / validation_split / test_split: split names; validation/test null: carved
            from train (``val_fraction`` / ``test_fraction`` of its rows, seeded).
        join: ``eos``: each row is a document followed by eos (empty rows dropped); ``concat``:
            rows are consecutive pieces of one text (wikitext's lines, which end in a newline) and
            are concatenated as they are, with no eos.
        tokenizer / bpe_vocab_size / num_proc / doc_mask / seq_len / batch_size / seed: as in ``data=text``
            (``doc_mask`` needs ``join=eos``: it is the eos that marks a document boundary). Pairs
            read neither ``join``, ``doc_mask`` nor ``seq_len``.
        source_len / target_len / truncate: pairs only: the most source ids, the most decoder
            positions (BOS and the target ids), and whether longer pairs are cut (counted in the
            log) or refused (``xfam.data.seq2seq.fit_pairs``).
        streaming: read the corpus lazily and tokenise it in the loader workers instead of preparing
            token shards (``xfam.data.streaming``): for corpora too large to prepare. ``path`` may then
            also be a local folder of data files (JSON lines, Parquet, CSV, text).
        eval_rows: streaming only: the rows each evaluation split takes (from the start of its stream,
            or of the documents carved from train), held in memory.
        shuffle_buffer: streaming only: documents ``datasets`` shuffles in a buffer (0: the source's
            order). A resume then skips the documents in the buffer: approximate.
        exact_resume: streaming only: refuse settings whose resume is approximate (a shuffle buffer).
    """

    def __new__(cls, **params: Any) -> HFSource:
        # Pairs are an HFPairs (a Seq2SeqSource): the registry builds "hf", the parameters choose the class.
        return super().__new__(HFPairs if cls is HFSource and is_pairs(params) else cls)

    def __init__(
        self,
        *,
        path: str = "Salesforce/wikitext",
        config_name: str | None = "wikitext-2-raw-v1",
        text_column: str = "text",
        source_column: str | None = None,
        target_column: str | None = None,
        train_split: str = "train",
        validation_split: str | None = "validation",
        test_split: str | None = "test",
        val_fraction: Annotated[float, Range(gt=0, lt=1)] = 0.05,
        test_fraction: Annotated[float, Range(gt=0, lt=1)] = 0.05,
        join: Literal["eos", "concat"] = "concat",
        tokenizer: str = "byte",
        bpe_vocab_size: Annotated[int, Range(ge=257)] = 4096,
        num_proc: Annotated[int, Range(ge=1)] | None = None,
        doc_mask: bool = False,
        seq_len: Annotated[int, Range(ge=1)] = 256,
        source_len: Annotated[int, Range(ge=1)] = 256,
        target_len: Annotated[int, Range(ge=2)] = 256,
        truncate: bool = False,
        batch_size: Annotated[int, Range(ge=1)] = 16,
        seed: int = 0,
        streaming: bool = False,
        eval_rows: Annotated[int, Range(ge=1)] = 256,
        shuffle_buffer: Annotated[int, Range(ge=0)] = 0,
        exact_resume: bool = True,
    ):
        self.path, self.config_name, self.text_column = path, config_name, text_column
        self.streaming, self.eval_rows, self.shuffle_buffer = streaming, eval_rows, shuffle_buffer
        self.source_column, self.target_column = source_column, target_column
        self.split_names = {"train": train_split, "validation": validation_split, "test": test_split}
        self.fractions = {"validation": val_fraction, "test": test_fraction}
        self.join_eos = join == "eos"
        self.tokenizer_kind, self.bpe_vocab_size, self.doc_mask = tokenizer, bpe_vocab_size, doc_mask
        self.num_proc = num_proc
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        pairs = {"source_column": source_column, "target_column": target_column}
        if problems := pair_problems(pairs):
            raise ConfigError(f"data=hf: {problems[0]}")
        if is_pairs(pairs):
            assert isinstance(self, HFPairs)  # (``__new__`` made it one; its class's task is seq2seq)
            lengths: dict[str, Any] = {"source_len": source_len, "target_len": target_len, "truncate": truncate}
            self.keep_lengths(**lengths, batch_size=batch_size, seed=seed)

    @classmethod
    def task_for(cls, params: dict[str, Any]) -> Task:
        return "seq2seq" if is_pairs(params) else cls.task

    @classmethod
    def contiguous_for(cls, params: dict[str, Any]) -> bool:
        return not params.get("streaming", False)  # streamed rows come from several units in turn

    @classmethod
    def check(cls, params: dict[str, Any], ctx: Any) -> list[str]:
        problems = pair_problems(params) + tokenizer_problems(params["tokenizer"])
        if params["doc_mask"] and params["join"] != "eos" and not is_pairs(params):
            problems.append("doc_mask=true needs join=eos (documents are delimited by eos). Fix: set data.join=eos.")
        carved = [params["val_fraction"]] * (params["validation_split"] is None)
        carved += [params["test_fraction"]] * (params["test_split"] is None)
        if sum(carved) >= 1:
            problems.append(f"the carved fractions sum to {sum(carved):g}, leaving no train rows. Fix: make it < 1.")
        roles: dict[str, str] = {}  # split name -> the first key naming it
        for k in ("train_split", "validation_split", "test_split"):
            name = params[k]
            if name in roles:  # one split twice: evaluating on training rows, or validation = test
                problems.append(
                    f"{k}={name!r} is also {roles[name]}: one split would serve both. Fix: another split name, or "
                    f"data.{k}=null to carve it from train."
                )
            elif name is not None:
                roles[name] = k
        problems += _streaming_problems(params)
        local = Path(params["path"]).expanduser()
        if local.is_dir():
            layout = _local_layout(local)
            if layout is None and params["streaming"] and is_data_folder(local):
                pass  # a folder of data files, which datasets streams by their type
            elif layout is None:
                problems.append(
                    f"path={params['path']!r} is a folder but not a datasets save_to_disk folder (no "
                    "dataset_dict.json or state.json). Fix: pass a save_to_disk folder, or use data=text "
                    f"paths=[{params['path']!r}] for a folder of text files."
                )
            else:
                problems += _split_problems(params, layout)
        elif local.exists() or params["path"].startswith(("/", "./", "../", "~")):
            problems.append(
                f"path={params['path']!r} is not an existing folder. Fix: pass a datasets save_to_disk folder "
                "or a hub id (e.g. Salesforce/wikitext); for text files use data=text."
            )
        return problems

    def prepare(self) -> None:
        if not self.streaming:
            return super().prepare()  # token shards (xfam.data.packing)
        if not getattr(self, "_splits", None):
            self._prepare_stream()

    def _prepare_stream(self) -> None:
        """The tokenizer, the evaluation splits (in memory) and the streamed train split (``xfam.data.streaming``)."""
        tok = build_tokenizer(self.tokenizer_kind, self.bpe_vocab_size, "", ())  # byte or pretrained (check())
        self.tokenizer, self.vocab_size, self.token_bytes = tok, tok.vocab_size, list(tok.token_bytes)
        self.eos_id = tok.eos_id if self.join_eos else None
        if self.join_eos and tok.eos_id is None:
            raise ConfigError(no_eos_message("hf", self.tokenizer_kind, tok))
        packer = Packer(tok, self.eos_id, self.seq_len, self.batch_size)
        carved = {name: self.fractions[name] for name in ("validation", "test") if self.split_names[name] is None}
        train = self.split_names["train"]
        assert train is not None  # (train_split is a name)
        self._splits = {}
        stats: dict[str, Any] = {}
        for name in ("validation", "test"):
            opener = Opener(self.path, self.config_name, self.split_names[name] or train, 0, self.seed)
            try:
                ids = eval_tokens(
                    opener, self.text_column, packer, self.eval_rows, name, carved if name in carved else {}
                )
            except (OSError, ValueError) as err:
                raise self._load_error(err) from err
            rows = PackedRows(ArrayStream(ids), self.seq_len)
            if len(rows) == 0:
                raise ConfigError(
                    f"data=hf: the streamed {name} split has {len(ids)} tokens, fewer than seq_len + 1 = "
                    f"{self.seq_len + 1}, so it makes no row. Fix: lower data.seq_len, or name a larger split."
                )
            self._splits[name] = rows
            stats[name] = {"tokens": len(rows.stream), "rows": len(rows)}
        opener = Opener(self.path, self.config_name, train, self.shuffle_buffer, self.seed)
        self._splits["train"] = StreamedSplit(opener, self.text_column, packer, carved)
        corpus = {
            "source": "hf",
            "streaming": True,
            "path": self.path,
            "config_name": self.config_name,
            "text_column": self.text_column,
            "splits_from": self.split_names,
            "carved": carved,
            "shuffle_buffer": self.shuffle_buffer,
            "seed": self.seed if self.shuffle_buffer else None,
        }
        self.fingerprint = short_hash(FORMAT, "stream", corpus, tok.config, self.join_eos, self.seq_len, self.eval_rows)
        stats["train"] = {"streamed": True}
        self.manifest = {
            **corpus,
            "tokenizer": tok.config,
            "join": "eos" if self.join_eos else "concat",
            "seq_len": self.seq_len,
            "eval_rows": self.eval_rows,
            "splits": stats,
            "fingerprint": self.fingerprint,
        }

    def _load(self) -> dict[str, Any]:
        import datasets

        local = Path(self.path).expanduser()
        if local.is_dir():
            loaded = datasets.load_from_disk(str(local))
            return {"train": loaded} if isinstance(loaded, datasets.Dataset) else dict(loaded)
        try:
            return dict(datasets.load_dataset(self.path, self.config_name))
        except (OSError, ValueError) as err:
            raise self._load_error(err) from err

    def _load_error(self, err: Exception) -> ConfigError:
        """The refusal of a dataset ``datasets`` could not load (offline and not cached, a bad name ...)."""
        import datasets

        what = f"data=hf: dataset {self.path!r} (config {self.config_name!r})"
        if Path(self.path).expanduser().exists():
            return ConfigError(
                f"{what} could not be read: {err}. Fix: check data.path, data.text_column and the split names "
                f"(data.train_split, data.validation_split, data.test_split; null carves one from train)."
            )
        save = "or, where there is network, save it with DatasetDict.save_to_disk(folder) and pass data.path=<folder>."
        if datasets.config.HF_HUB_OFFLINE or datasets.config.HF_DATASETS_OFFLINE:
            return ConfigError(
                f"{what} is not available offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are set and it is not "
                f"in the local cache). Fix: unset HF_HUB_OFFLINE and HF_DATASETS_OFFLINE on a machine with "
                f"network, {save}"
            )
        return ConfigError(f"{what} could not be loaded: {err}. Fix: check data.path and data.config_name, {save}")

    def documents(self) -> tuple[dict[str, Any], str, str, dict[str, Any]]:
        docs, corpus_fp, corpus = self.load_splits({"text_column": self.text_column})
        return docs, self.text_column, corpus_fp, corpus

    def load_splits(self, columns: dict[str, str]) -> tuple[dict[str, Any], str, dict[str, Any]]:
        """Per split the ``datasets.Dataset`` to read (given or carved from train), the corpus fingerprint and
        the corpus part of the manifest; ``columns``: ``{"text_column": ...}`` or the two pair columns."""
        loaded = self._load()
        layout = {name: dict(ds.features.to_dict()) for name, ds in loaded.items()}
        params = {f"{k}_split": v for k, v in self.split_names.items()} | columns
        if problems := _split_problems(params, layout):
            raise ConfigError([f"data=hf: {p}" for p in problems])
        train_split = self.split_names["train"]
        assert train_split is not None  # (train_split is a name)
        train = loaded[train_split]
        docs = {name: loaded[given] for name in SPLITS if (given := self.split_names[name]) is not None}
        carve = [name for name in SPLITS if name not in docs]
        if carve:
            order = np.random.default_rng(self.seed).permutation(len(train))
            start = 0
            for name in carve:
                n = max(1, round(self.fractions[name] * len(train)))
                docs[name] = train.select(np.sort(order[start : start + n]))
                start += n
            docs["train"] = train.select(np.sort(order[start:]))
        sources = {name: loaded[n]._fingerprint for name, n in self.split_names.items() if n is not None}
        corpus = {
            "source": "hf",
            "path": self.path,
            "config_name": self.config_name,
            **columns,
            "splits_from": self.split_names,
            "carved": {name: self.fractions[name] for name in carve},
            "seed": self.seed if carve else None,
            "dataset_fingerprints": sources,
            "rows": {name: len(ds) for name, ds in docs.items()},
        }
        corpus_fp = short_hash({k: v for k, v in corpus.items() if k != "path"})
        return {name: docs[name] for name in SPLITS}, corpus_fp, corpus


class HFPairs(PairsMixin, HFSource):
    """``data=hf`` with ``source_column`` and ``target_column``: (source, target) text pairs (``xfam.data.hf_pairs``).

    Not registered itself: ``HFSource(**params)`` (the registry's ``hf``) returns one when both columns are set.
    """
