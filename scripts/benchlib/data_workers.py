"""Worker side of scripts/bench_data.py: each measurement runs in a fresh process (``bench_data.py --worker SPEC``,
``worker_main``), does one thing to a data source -- prepare it cold or warm, iterate its loader, write the
``data=hf`` twin of a corpus -- and prints its JSON result on one stdout line (``RESULT``). Also two helpers the
parent calls: the benchmark's BPE ``tokenizer.json`` (``train_gpt2_bpe``) and the reader of a train.py cProfile
(``train_profile``).

One file over 400 lines: the worker kinds share their measuring helpers (``PeakMemory``, ``Stages``, ``_source``)
and one entry point, and each is short."""

from __future__ import annotations

import json
import os
import resource
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

RESULT = "BENCH_DATA_RESULT "  # prefix of a worker's JSON line on stdout
EOT = "<|endoftext|>"


def train_gpt2_bpe(texts: Iterable[str], vocab_size: int, path: Path) -> dict[str, Any]:
    """A GPT-2-style byte-level BPE (``tokenizers``: ByteLevel pre-tokenizer without a prefix space, ByteLevel
    decoder and post-processor, the 256 byte symbols in the vocabulary, ``<|endoftext|>`` as its only special
    token) trained on ``texts``, saved as the ``tokenizer.json`` ``path``; its vocabulary and training time."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    t0 = time.perf_counter()
    tok.train_from_iterator(texts, trainer=trainer)
    seconds = time.perf_counter() - t0
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return {"path": str(path), "vocab": tok.get_vocab_size(), "train_s": round(seconds, 2)}


def work_hf_dataset(spec: dict[str, Any]) -> dict[str, Any]:
    """A ``Dataset.save_to_disk`` folder ``spec["folder"]`` of one ``text`` column: a row per ``*.py`` file of the
    corpus ``spec["corpus"]``, in path order, decoded as UTF-8 (U+FFFD for invalid bytes), in the Arrow files
    ``save_to_disk`` cuts (500 MB each); the UTF-8 bytes of the column. A worker too, so that the parent's memory
    stays small: a child's max RSS starts from its parent's at the fork."""
    import datasets
    import pyarrow.compute as pc

    files = sorted(Path(spec["corpus"]).rglob("*.py"))

    def rows() -> Iterable[dict[str, str]]:
        for f in files:
            yield {"text": f.read_bytes().decode("utf-8", errors="replace")}

    ds = datasets.Dataset.from_generator(rows, features=datasets.Features({"text": datasets.Value("string")}))
    ds.save_to_disk(spec["folder"])
    return {"bytes": int(pc.sum(pc.binary_length(ds.data.column("text"))).as_py())}


class PeakMemory:
    """Peak memory while a worker runs: ``getrusage`` max RSS of this process and of its largest waited-for child,
    and the process tree's PSS (total and anonymous), sampled every ``every_s`` seconds by a thread."""

    def __init__(self, every_s: float = 0.05):
        self.every_s = every_s
        self.peak_pss = self.peak_anon = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _tree(pid: int) -> list[int]:
        """``pid`` and its descendants (``/proc/<pid>/task/*/children``)."""
        out, todo = [], [pid]
        while todo:
            p = todo.pop()
            out.append(p)
            try:
                for task in os.listdir(f"/proc/{p}/task"):
                    with open(f"/proc/{p}/task/{task}/children") as f:
                        todo += [int(c) for c in f.read().split()]
            except OSError:
                continue
        return out

    @staticmethod
    def _pss(pid: int) -> tuple[float, float]:
        """(Pss, Pss_Anon) of one process in MiB; zeros if it is gone."""
        pss = anon = 0.0
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        pss = int(line.split()[1]) / 1024
                    elif line.startswith("Pss_Anon:"):
                        anon = int(line.split()[1]) / 1024
        except OSError:
            pass
        return pss, anon

    def sample(self) -> tuple[float, float]:
        pairs = [self._pss(p) for p in self._tree(os.getpid())]
        return sum(p for p, _ in pairs), sum(a for _, a in pairs)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            pss, anon = self.sample()
            self.peak_pss, self.peak_anon = max(self.peak_pss, pss), max(self.peak_anon, anon)

    def __enter__(self) -> PeakMemory:
        self.baseline_pss, self.baseline_anon = self.sample()
        self.baseline_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        self.peak_pss, self.peak_anon = self.baseline_pss, self.baseline_anon
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def result(self) -> dict[str, float]:
        return {
            "baseline_rss_mb": round(self.baseline_rss, 1),  # max RSS after the imports, before the work
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "children_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
            "baseline_pss_mb": round(self.baseline_pss, 1),
            "peak_pss_mb": round(self.peak_pss, 1),
            "peak_anon_pss_mb": round(self.peak_anon, 1),
        }


class Stages:
    """Seconds spent in wrapped functions (``wrap(owner, name, label)``), summed over calls."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, owner: Any, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - t0

        setattr(owner, name, timed)

    def result(self) -> dict[str, float]:
        return {k: round(v, 4) for k, v in self.seconds.items()}


class LogLines:
    """The ``xfam`` logger's messages during a worker (its ``tokenize ...`` lines go into the report)."""

    def __init__(self) -> None:
        import logging

        self.lines: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: self.lines.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("xfam").addHandler(handler)
        logging.getLogger("xfam").setLevel(logging.INFO)


#: ``data=hf`` settings of the start-up part: a ``save_to_disk`` folder of one text column, documents joined with
#: eos, validation and test carved from train (the train.py overrides of ``bench_data.HF_OVERRIDES``).
HF_SETTINGS = {"config_name": None, "join": "eos", "validation_split": None, "test_split": None}


def _source(spec: dict[str, Any]) -> Any:
    """``data=text`` on ``spec["paths"]``, or with ``spec["hf"]`` ``data=hf`` on that ``save_to_disk`` folder."""
    common = {"tokenizer": spec.get("tokenizer", "byte"), "num_proc": spec.get("num_proc")}
    if spec.get("hf"):
        from xfam.data.hf import HFSource

        return HFSource(path=spec["hf"], **HF_SETTINGS, **common)
    from xfam.data.text import TextSource

    return TextSource(paths=spec.get("paths"), **common)


def _corpus_size(source: Any) -> dict[str, int]:
    """Text bytes, tokens and shards of a prepared source, all splits, and its files (``data=hf``: the Arrow files
    of its folder)."""
    splits = source.manifest["splits"].values()
    files = source.manifest.get("files") or list(Path(source.manifest.get("path", "")).glob("*.arrow"))
    return {
        "text_bytes": sum(s["text_bytes"] for s in splits),
        "tokens": sum(s["tokens"] for s in splits),
        "shards": sum(len(s["shards"]) for s in splits),
        "files": len(files),
    }


def work_prepare_xfam(spec: dict[str, Any]) -> dict[str, Any]:
    """xfam's ``prepare()`` on a cold cache: end to end, the reading and tokenising stages, peak memory."""
    import xfam.data.shards as shards

    lines, stages, source = LogLines(), Stages(), _source(spec)
    stages.wrap(type(source), "documents", "reading")
    stages.wrap(shards, "run_jobs", "tokenising")
    with PeakMemory() as mem:
        t0 = time.perf_counter()
        source.prepare()
        total = time.perf_counter() - t0
    return {
        "total_s": round(total, 3),
        **{f"{k}_s": v for k, v in stages.result().items()},
        **_corpus_size(source),
        "memory": mem.result(),
        "log": [ln for ln in lines.lines if "tokenize" in ln],
    }


def work_prepare_map(spec: dict[str, Any]) -> dict[str, Any]:
    """``Dataset.map`` over xfam's documents with the same tokenizer's ``encode_docs``, into Arrow cache files."""
    import numpy as np
    import pyarrow.compute as pc

    from xfam.data.tokenize import build_tokenizer, cache_root, token_dtype

    source = _source(spec)
    with PeakMemory() as mem:
        t0 = time.perf_counter()
        docs, column, corpus_fp, corpus = source.documents()
        reading = time.perf_counter() - t0
        tok = build_tokenizer(source.tokenizer_kind, source.bpe_vocab_size, corpus_fp, iter(()))
        dtype = token_dtype(tok.vocab_size)
        eos = np.array([tok.eos_id], dtype=dtype)

        def encode(batch: dict[str, list]) -> dict[str, list]:
            return {"ids": [np.concatenate([a.astype(dtype, copy=False), eos]) for a in tok.encode_docs(batch[column])]}

        out = cache_root() / "bench_map"
        out.mkdir(parents=True, exist_ok=True)
        procs = spec["num_proc"]
        t1, tokens = time.perf_counter(), 0
        for name, ds in docs.items():
            mapped = ds.map(
                encode,
                batched=True,
                batch_size=256,
                num_proc=procs if procs > 1 else None,
                remove_columns=ds.column_names,
                cache_file_name=str(out / f"{name}.arrow"),
                new_fingerprint=f"bench-{name}-{procs}",
                desc=f"datasets.map {name}",
            )
            tokens += int(pc.sum(pc.list_value_length(mapped.with_format("arrow")["ids"])).as_py() or 0)
        tokenising = time.perf_counter() - t1
    return {
        "total_s": round(reading + tokenising, 3),
        "reading_s": round(reading, 4),
        "tokenising_s": round(tokenising, 4),
        "text_bytes": corpus["total_bytes"],
        "tokens": tokens,
        "files": len(corpus["files"]),
        "memory": mem.result(),
    }


def work_prepare_plain(spec: dict[str, Any]) -> dict[str, Any]:
    """One process: read each file, encode it, append the ids and eos to a list; concatenate and save."""
    import numpy as np

    from xfam.data.files import discover
    from xfam.data.tokenize import build_tokenizer, cache_root, token_dtype

    found, problems = discover(spec["paths"], [".py"])
    if problems:
        raise RuntimeError("; ".join(problems))
    tok = build_tokenizer(spec["tokenizer"], 4096, "", iter(()))
    dtype = token_dtype(tok.vocab_size)
    eos = np.array([tok.eos_id], dtype=dtype)
    out = cache_root() / "bench_plain" / "ids.npy"
    out.parent.mkdir(parents=True, exist_ok=True)
    reading = tokenising = 0.0
    text_bytes = 0
    with PeakMemory() as mem:
        ids: list[Any] = []
        for _, path in found:
            t0 = time.perf_counter()
            data = path.read_bytes()
            t1 = time.perf_counter()
            ids += [tok.encode_docs([data])[0].astype(dtype, copy=False), eos]
            reading, tokenising = reading + t1 - t0, tokenising + time.perf_counter() - t1
            text_bytes += len(data)
        t0 = time.perf_counter()
        flat = np.concatenate(ids)
        np.save(out, flat)
        tokenising += time.perf_counter() - t0
    return {
        "total_s": round(reading + tokenising, 3),
        "reading_s": round(reading, 4),
        "tokenising_s": round(tokenising, 4),
        "text_bytes": text_bytes,
        "tokens": int(len(flat)),
        "files": len(found),
        "memory": mem.result(),
    }


def _top_functions(profile: Any, n: int) -> list[dict[str, Any]]:
    """The ``n`` functions of a cProfile with the most own time: label, calls, own and cumulative seconds."""
    import pstats

    stats = pstats.Stats(profile).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    rows = []
    for (file, line, name), (_, calls, own, cum, _) in stats.items():
        label = name if file == "~" else f"{Path(file).parent.name}/{Path(file).name}:{line}({name})"
        rows.append({"function": label, "calls": calls, "own_s": round(own, 4), "cum_s": round(cum, 4)})
    return sorted(rows, key=lambda r: -r["own_s"])[:n]


#: Functions of a train.py start-up whose cumulative time the profile reports: (file suffix, name, label).
PROFILED = (
    ("xfam/training/hydra_app.py", "main", "the whole run (`hydra_app.main`)"),
    ("xfam/config/validation.py", "validate", "config validation (`validate`)"),
    ("xfam/core/registry.py", "build", "building the components (`Registry.build`)"),
    ("xfam/data/text.py", "check", "`TextSource.check`"),
    ("xfam/data/files.py", "discover", "`discover` (find the files; its result kept for the process)"),
    ("xfam/data/files.py", "_walk", "`_walk` (os.scandir; the walk kept for the process)"),
    ("xfam/data/files.py", "of", "`FileFacts.of` (a file's size and sha256, remembered)"),
    ("xfam/data/packing.py", "prepare", "`PackedLM.prepare`"),
    ("xfam/data/text.py", "documents", "`TextSource.documents`"),
    ("xfam/training/runner.py", "write_record", "`write_record` (the run's manifest)"),
)


def train_profile(path: Path) -> dict[str, Any]:
    """From a cProfile of train.py: calls and cumulative seconds of ``PROFILED``, and who calls ``discover``."""
    import pstats

    stats = pstats.Stats(str(path)).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)

    def key(suffix: str, name: str) -> tuple | None:
        found = [k for k in stats if k[0].endswith(suffix) and k[2] == name]
        return max(found, key=lambda k: stats[k][3]) if found else None

    def where(k: tuple) -> str:
        return f"{Path(k[0]).parent.name}/{Path(k[0]).name}:{k[1]}({k[2]})"

    functions, callers = [], {}
    for suffix, name, label in PROFILED:
        if (k := key(suffix, name)) is not None:
            functions.append(
                {"label": label, "function": where(k), "calls": stats[k][1], "cum_s": round(stats[k][3], 2)}
            )
    for file, name in (("xfam/data/files.py", "discover"), ("xfam/data/text.py", "check")):
        if (k := key(file, name)) is not None:
            callers[name] = {where(c): v[1] for c, v in stats[k][4].items()}
    if (k := key("xfam/config/validation.py", "validate")) is not None:
        callers["validate"] = {where(c): v[1] for c, v in stats[k][4].items()}
    return {"functions": functions, "callers": callers}


def work_warm_prepare(spec: dict[str, Any]) -> dict[str, Any]:
    """``prepare()`` on a warm cache, by stage; ``data=text``: then one more ``discover`` (the walk kept for the
    process, as train.py's later calls find it); with ``profile``, a second, profiled ``prepare()``."""
    import cProfile

    import xfam.data.packing as packing
    import xfam.data.text as text

    stages, source = Stages(), _source(spec)
    stages.wrap(type(source), "documents", "documents")
    stages.wrap(text, "discover", "discover")
    stages.wrap(text, "cached_generate", "documents_cache")
    stages.wrap(packing, "doc_bytes", "doc_bytes")
    stages.wrap(packing, "build_tokenizer", "tokenizer")
    stages.wrap(packing, "prepare_split", "shards")
    t0 = time.perf_counter()
    source.prepare()
    total = time.perf_counter() - t0
    s = stages.result()
    res = {
        "total_s": round(total, 4),
        "stages": {
            "discover": s.get("discover", 0.0),
            "read_hash": round(s["documents"] - s.get("discover", 0.0) - s.get("documents_cache", 0.0), 4),
            "documents_cache": s.get("documents_cache", 0.0),
            "doc_bytes": s.get("doc_bytes", 0.0),
            "tokenizer": s.get("tokenizer", 0.0),
            "shards": s.get("shards", 0.0),
        },
        **_corpus_size(source),
    }
    res["stages"]["other"] = round(total - sum(res["stages"].values()), 4)
    if not spec.get("hf"):
        t0 = time.perf_counter()
        text.discover(source.paths, source.extensions)
        res["discover_again_s"] = round(time.perf_counter() - t0, 4)
    if spec.get("profile"):
        profile = cProfile.Profile()
        again = _source(spec)
        profile.enable()
        again.prepare()
        profile.disable()
        res["profile"] = _top_functions(profile, 10)
    return res


def work_loader(spec: dict[str, Any]) -> dict[str, Any]:
    """Tokens/s the training DataLoader delivers, no model, for each of ``spec["num_workers"]`` in turn."""
    import xfam.data.module  # noqa: F401  (Lightning: imported before the clock)

    source = _source(spec)
    source.prepare()
    return {"loaders": [loader_rate(source, n, spec) | {"num_workers": n} for n in spec["num_workers"]]}


def loader_rate(source: Any, num_workers: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Tokens/s of ``XfamDataModule(source, seed=0, num_workers=...).train_dataloader()``: the median of
    ``windows`` windows of ~``window_s`` s after ``warmup`` batches."""
    import torch

    from xfam.data.module import XfamDataModule

    module = XfamDataModule(source, seed=0, num_workers=num_workers)
    loader = module.train_dataloader()
    it = iter(loader)

    def batch() -> Any:
        nonlocal it
        try:
            return next(it)
        except StopIteration:  # (an epoch ended: the next one)
            it = iter(loader)
            return next(it)

    t0 = time.perf_counter()
    first = batch()  # workers start here
    first_s = time.perf_counter() - t0
    for _ in range(spec["warmup"]):
        batch()
    rates, batches = [], 0
    for _ in range(spec["windows"]):
        t0, tokens = time.perf_counter(), 0
        while time.perf_counter() - t0 < spec["window_s"]:
            tokens += batch()["input_ids"].numel()
            batches += 1
        rates.append(tokens / (time.perf_counter() - t0))
    return {
        "tokens_per_s": round(statistics.median(rates), 1),
        "windows": [round(r, 1) for r in rates],
        "batches": batches,
        "batch_shape": list(first["input_ids"].shape),
        "first_batch_s": round(first_s, 3),
        "rows": len(source.split("train")),
        "threads": torch.get_num_threads(),
    }


WORKERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "xfam": work_prepare_xfam,
    "datasets.map": work_prepare_map,
    "plain loop": work_prepare_plain,
    "warm": work_warm_prepare,
    "loader": work_loader,
    "hf_dataset": work_hf_dataset,
}


def worker_main(spec_json: str) -> None:
    """A worker process: one measurement of ``spec["kind"]``; its JSON result on one stdout line."""
    import datasets  # noqa: F401  (imported before any clock starts: the measurements time the work only)
    import torch

    import xfam.data.text  # noqa: F401

    torch.set_num_threads(1)
    spec = json.loads(spec_json)
    res = WORKERS[spec["kind"]](spec)
    print(RESULT + json.dumps(res), flush=True)


# ---------------------------------------------------------------------------------------- parent side
