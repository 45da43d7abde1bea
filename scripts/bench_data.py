#!/usr/bin/env python
"""Data at scale: token-shard preparation throughput, start-up time after preparation, loader vs training speed.

One file over 400 lines: the protocol below, the corpora and the orchestration of the three parts are read
together (the workers and the report are ``benchlib.data_workers`` and ``benchlib.data_report``).

Three measurements of ``data=text`` (``xfam.data.text.TextSource``, whose ``prepare()`` tokenises each split in
parallel into memory-mapped token shards, ``xfam.data.shards``), each in fresh subprocesses
(``benchlib.data_workers``, run as ``bench_data.py --worker SPEC``) with ``HF_DATASETS_CACHE`` in a temp folder,
``TOKENIZERS_PARALLELISM=false`` (one core per process) and 1 torch thread:

1. **Preparation throughput** on ``--corpus-mb`` MB of text (default 100; MB = 10^6 bytes): the standard library's
   ``*.py`` files (``data=text``'s default corpus) copied in order into ``copy-000/``, ``copy-001/`` ... until the
   size is reached, copy k of each file starting with ``# copy k`` (distinct documents; ``build_corpus``, built
   once under ``--work``), read once before (page cache). Tokenizers: ``byte``, and a GPT-2-style byte-level BPE
   (``tokenizers``, ``<|endoftext|>`` its only special token, vocabulary ``--bpe-vocab``) trained on the first
   ``--bpe-train-mb`` MB of the standard library, passed as ``tokenizer=<tokenizer.json>``. Each system on a cold
   cache: **xfam** ``TextSource(paths=[corpus], num_proc=1 | 2).prepare()``, end to end and by stage (wrapped in
   the worker: ``TextSource.documents``, *reading*: walk, read and sha256 every file, Arrow documents cache;
   ``xfam.data.shards.run_jobs``, *tokenising*); **datasets.map**: the same documents, then
   ``Dataset.map(batched=True, batch_size=256, num_proc=1 | 2)`` of the same tokenizer's ``encode_docs`` + eos into
   Arrow cache files; a **plain loop**: read, encode, append, ``numpy.save``. MB/s: text bytes of all splits over
   seconds. Peak memory: ``getrusage`` max RSS of the worker and of its largest child, and the process tree's PSS
   (a shared page counted once) sampled every 50 ms, with its anonymous part (not the file pages of memory-mapped
   caches, which the kernel can drop); xfam ``num_proc=2`` on a half-size corpus and part 2's big one too.
2. **Start-up after preparation** (byte tokenizer): ``data=text`` on the default corpus (the standard library,
   ~31 MB), part 1's and a big one of ``--big-gb`` GB (default 1.0, built as above); and ``data=hf`` (``HF_OVERRIDES``)
   on ``save_to_disk`` folders of the same text as part 1's and the big corpus (one ``text`` column, a row per file,
   in a few Arrow files: ``build_hf_corpus``): the same bytes in a few large files instead of many small ones, to
   tell what grows with the files from what grows with the bytes. Each is prepared once (timed: the cold
   preparation), then ``python train.py [data.paths=[corpus] | data=hf ...] trainer.max_steps=1`` + ``SHORT_RUN``
   runs ``--startup-reps`` times (default 3; a fresh run folder each): seconds from the process start to its log
   line ``step 1/1`` (the first step done), and to ``allocator: ...`` (imports, config and its checks done) and
   ``loader.streams=...`` (data prepared, model built); medians. Then the warm ``prepare()`` by stage (wrapped:
   ``discover``, the documents' ``cached_generate``, the rest of ``documents()`` -- text: each file's size and
   sha256, remembered by ``FileFacts``; hf: ``load_from_disk`` and the carving --, ``build_tokenizer``,
   ``prepare_split``) and, for text, one more ``discover`` (the walk kept for the process, as train.py's later
   calls find it); for the biggest text corpus a cProfile of it and one ``train.py`` run under ``python -m
   cProfile`` (not in ``--quick``): the calls and cumulative time of the validation, ``discover`` ... and who
   calls ``discover``.
3. **Loader vs training** on the default corpus at the default batch (16 x 256): tokens/s that ``XfamDataModule(
   source, seed=0, num_workers=0 | 2).train_dataloader()`` delivers without a model (medians of
   ``--loader-windows`` windows of ~1 s after 20 batches), against ``train/tokens_per_s`` of ``python train.py``
   with the default config (``model=tiny``, ``--threads`` torch threads) for ``--train-steps`` steps (xfam's
   ``Throughput`` callback: the median after 3 warm-up steps, the wait for each batch included). Target: >= 20x.

Every measurement starts once other processes used under ``--quiet`` cores (default 0.3) for 2 s, or after
``--max-wait`` seconds (``benchlib.protocol.wait_for_quiet``), and records the cores other processes used while
it ran (/proc/stat busy time minus this benchmark's): the machine is shared, so the times are indicative. Each
part records the date, commit and command of the run that measured it (``measured``, kept by ``--keep-json``).
The report (``benchlib.data_report``) is a marked section of docs/benchmarks.md and docs/benchmarks_data.png.

    python scripts/bench_data.py --quick                 # tiny corpora, no waiting: a check that it all runs (~2 min)
    python scripts/bench_data.py --json data.json        # the full run (~15 min); docs/benchmarks{.md,_data.png}
    python scripts/bench_data.py --parts startup,loader --keep-json data.json --json new.json
                                                         # re-measure two parts, keep the third from data.json

References: nanoGPT's ``prepare.py`` (Karpathy, 2022: ids written once to a flat ``uint16`` file, read as windows
at training time), the approach ``xfam.data.shards`` follows; GPT-2's byte-level BPE (Radford et al., 2019);
Hugging Face ``datasets`` (Lhoest et al., EMNLP 2021 demos) ``Dataset.map``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib.common import ROOT, cpu_busy_s
from benchlib.data_report import MB, MILESTONES, SHORT_RUN, START, describe_prep, print_summary, write_report
from benchlib.data_workers import HF_SETTINGS, RESULT, train_gpt2_bpe, train_profile, worker_main

#: train.py overrides of the ``data=hf`` rows of part 2 (``data.path=<folder>`` added): ``HF_SETTINGS``.
HF_OVERRIDES = ["data=hf"] + [f"data.{k}={'null' if v is None else v}" for k, v in HF_SETTINGS.items()]


def log(msg: str, started: float | None = None) -> None:
    prefix = f"[{time.perf_counter() - started:5.0f} s] " if started is not None else ""
    print(prefix + msg, flush=True)


# ---------------------------------------------------------------------------------------- corpus and tokenizer


def stdlib_files() -> tuple[Path, list[Path]]:
    """The standard library's root and the ``*.py`` files ``data=text`` reads by default, in its order."""
    from xfam.data.files import discover, stdlib_root

    found, problems = discover(None, [".py"])
    if problems:
        raise RuntimeError("; ".join(problems))
    return stdlib_root(), [p for _, p in found]


def build_corpus(root: Path, target_bytes: int, base: Path | None = None, files: list[Path] | None = None) -> dict:
    """A corpus of about ``target_bytes`` bytes of text in ``root``: ``files`` (relative to ``base``; default the
    standard library's ``*.py``) copied in order into ``copy-000/``, ``copy-001/`` ... until the size is reached,
    copy k of each file starting with ``# copy k`` (distinct documents). Reused when ``root/corpus.json`` says it
    was built from the same files to the same size; built in ``root.tmp`` and renamed (an interrupted build is
    redone)."""
    if files is None:
        base, files = stdlib_files()
    assert base is not None
    manifest = root / "corpus.json"
    key = {"target_bytes": int(target_bytes), "base": str(base), "sources": len(files)}
    if manifest.exists():
        info = json.loads(manifest.read_text())
        if {k: info.get(k) for k in key} == key:
            return info
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    sources = [(p.relative_to(base), p.read_bytes()) for p in files]
    if not sources or not any(data for _, data in sources):
        raise ValueError(f"build_corpus: no text in the {len(files)} source files under {base}")
    total, count, copy = 0, 0, 0
    while total < target_bytes:
        for rel, data in sources:
            if total >= target_bytes:
                break
            out = tmp / f"copy-{copy:03d}" / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            text = f"# copy {copy}\n".encode() + data
            out.write_bytes(text)
            total, count = total + len(text), count + 1
        copy += 1
    info = {**key, "root": str(root), "bytes": total, "files": count, "copies": copy}
    (tmp / "corpus.json").write_text(json.dumps(info, indent=1))
    tmp.rename(root)
    return info


def read_all(root: Path) -> int:
    """Read every file under ``root`` once (into the page cache); returns the bytes read."""
    return sum(len(p.read_bytes()) for p in root.rglob("*") if p.is_file())


def bpe_tokenizer(work: Path, vocab: int, train_mb: float) -> dict[str, Any]:
    """The benchmark's BPE ``tokenizer.json`` under ``work``, trained on the first ``train_mb`` MB of the standard
    library's ``*.py`` files (reused when it exists)."""
    path = work / f"bpe-{vocab}-{train_mb:g}mb" / "tokenizer.json"
    meta = path.with_name("meta.json")
    if path.exists() and meta.exists():
        return json.loads(meta.read_text())
    _, files = stdlib_files()
    texts, size = [], 0
    for p in files:
        if size >= train_mb * MB:
            break
        data = p.read_bytes()
        texts.append(data.decode("utf-8", errors="replace"))
        size += len(data)
    info = train_gpt2_bpe(texts, vocab, path) | {"train_mb": round(size / MB, 2)}
    meta.write_text(json.dumps(info))
    return info


def build_hf_corpus(root: Path, corpus: dict[str, Any], timeout: float = 1800) -> dict[str, Any]:
    """The ``data=hf`` twin of ``corpus``: a ``save_to_disk`` folder ``root`` of its files' text, written by a worker
    (``work_hf_dataset``). Reused when ``root/xfam_bench.json`` says it was built from the same corpus; built in
    ``root.tmp`` and renamed."""
    marker = root / "xfam_bench.json"
    key = {"from": corpus["root"], "from_bytes": corpus["bytes"], "rows": corpus["files"]}
    info = json.loads(marker.read_text()) if marker.exists() else {}
    if {k: info.get(k) for k in key} == key:
        return info
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="cache-", dir=root.parent) as cache:  # (the generator's datasets cache)
        made = run_worker({"kind": "hf_dataset", "corpus": corpus["root"], "folder": str(tmp)}, Path(cache), timeout)
    info = key | {"root": str(root), "bytes": made["bytes"], "files": len(list(tmp.glob("*.arrow")))}
    (tmp / marker.name).write_text(json.dumps(info, indent=1))
    tmp.rename(root)
    return info


# ---------------------------------------------------------------------------------------- measurements


def own_cpu_s() -> float:
    """CPU seconds of this process and its finished children (the benchmark's own work)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class Foreign:
    """Cores other processes used while a measurement ran: the machine's busy CPU time minus this benchmark's."""

    def __enter__(self) -> Foreign:
        self.busy0, self.own0, self.t0 = cpu_busy_s()[0], own_cpu_s(), time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wall_s = time.perf_counter() - self.t0
        others = (cpu_busy_s()[0] - self.busy0) - (own_cpu_s() - self.own0)
        self.cores = max(0.0, others / max(self.wall_s, 1e-9))


def child_env(cache: Path, threads: int, runs: Path | None = None) -> dict[str, str]:
    """A clean, offline environment: the datasets cache ``cache``, ``threads`` torch/OMP threads, tokenizers on one
    thread per process (except in train.py runs), run directories under ``runs``."""
    env = {k: v for k, v in os.environ.items() if k not in ("XFAM_DEBUG", "HF_HOME")}
    env |= {"HF_DATASETS_CACHE": str(cache), "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    env |= {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env |= {"WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    return env if runs is None else env | {"XFAM_RUNS": str(runs)}


def wait_quiet(args: argparse.Namespace) -> dict[str, float]:
    """Wait (at most ``--max-wait`` s) until other processes use under ``--quiet`` cores
    (``benchlib.protocol.wait_for_quiet``); the wait and the load seen last."""
    from benchlib import protocol

    waited, load = protocol.wait_for_quiet(args) if args.max_wait > 0 else (0.0, float("nan"))
    return {"waited_s": waited, "load_before": load}


def run_worker(spec: dict[str, Any], cache: Path, timeout: float) -> dict[str, Any]:
    """Run one worker (this script, ``--worker``) with the datasets cache ``cache``; its result."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    proc = subprocess.run(cmd, env=child_env(cache, 1), capture_output=True, text=True, timeout=timeout)
    lines = [ln[len(RESULT) :] for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if proc.returncode or not lines:
        raise RuntimeError(f"worker {spec} failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


def spawn(spec: dict[str, Any], cache: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``run_worker`` once the machine is quiet: its result, wall time, the wait and the cores other processes used
    meanwhile."""
    quiet = wait_quiet(args)
    with Foreign() as load:
        res = run_worker(spec, cache, args.timeout)
    return res | {"wall_s": round(load.wall_s, 2), "foreign_cores": round(load.cores, 2)} | quiet


def time_train(
    overrides: list[str], cache: Path, args: argparse.Namespace, profile: Path | None = None
) -> dict[str, Any]:
    """``python train.py *overrides`` (``--threads`` torch threads) in a fresh run folder once the machine is quiet:
    seconds from the start to each milestone line (``MILESTONES``), the whole run and its ``metrics.json``; with
    ``profile``, under ``cProfile`` (its stats written there)."""
    runs = Path(tempfile.mkdtemp(prefix="xfam_bench_data_runs_", dir="/tmp"))
    prof = [] if profile is None else ["-m", "cProfile", "-o", str(profile)]
    cmd = [sys.executable, *prof, str(ROOT / "train.py"), *overrides]
    seen: dict[str, float] = {}
    tail: list[str] = []
    env = {k: v for k, v in child_env(cache, args.threads, runs).items() if k != "TOKENIZERS_PARALLELISM"}
    quiet = wait_quiet(args)
    try:
        with Foreign() as load:
            t0 = time.perf_counter()
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            assert proc.stdout is not None
            for line in proc.stdout:
                now = time.perf_counter() - t0
                for name, pattern in MILESTONES.items():
                    if name not in seen and pattern.search(line):
                        seen[name] = round(now, 3)
                tail = (tail + [line.rstrip()])[-40:]
            rc = proc.wait(timeout=args.timeout)
            total = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"train.py {' '.join(overrides)} failed (rc={rc}):\n" + "\n".join(tail))
        metrics = next(runs.rglob("metrics.json"), None)
        return {
            "milestones_s": seen,
            "total_s": round(total, 3),
            "metrics": json.loads(metrics.read_text()) if metrics else {},
            "foreign_cores": round(load.cores, 2),
        } | quiet
    finally:
        shutil.rmtree(runs, ignore_errors=True)


def bench_prepare(args: argparse.Namespace, work: Path, corpora: dict[str, dict], started: float) -> dict[str, Any]:
    """Part 1: every system on every tokenizer on the full corpus, then xfam num_proc=2 on the half corpus."""
    bpe = bpe_tokenizer(work, args.bpe_vocab, args.bpe_train_mb)
    log(f"BPE tokenizer: vocab {bpe['vocab']:,}, trained on {bpe['train_mb']} MB in {bpe['train_s']} s", started)
    tokenizers = {"byte": "byte", f"bpe{bpe['vocab'] // 1024}k": bpe["path"]}
    every = [("xfam", 1), ("xfam", 2), ("datasets.map", 1), ("datasets.map", 2), ("plain loop", 1)]
    byte, bpe_name = list(tokenizers)
    plan = [("full", t, s, n) for t in tokenizers for s, n in every] + [("half", t, "xfam", 2) for t in tokenizers]
    if args.quick:  # every system once, the BPE path once; the memory table gets the big corpus of part 2
        plan = [("full", byte, s, n) for s, n in every] + [("full", bpe_name, "xfam", 2)]
    runs = []
    for corpus_name in dict.fromkeys(c for c, *_ in plan):
        corpus = corpora[corpus_name]
        read_all(Path(corpus["root"]))  # into the page cache: every system reads from memory
        for tok_name, system, procs in [(t, s, n) for c, t, s, n in plan if c == corpus_name]:
            spec = {"kind": system, "paths": [corpus["root"]], "tokenizer": tokenizers[tok_name], "num_proc": procs}
            for rep in range(args.prep_reps):
                with tempfile.TemporaryDirectory(prefix="cache-", dir=work) as cache:  # a cold cache each
                    r = spawn(spec, Path(cache), args)
                r |= {"system": system, "num_proc": procs, "tokenizer": tok_name, "corpus": corpus_name, "rep": rep}
                runs.append(r)
                log(f"prepare {corpus_name} {tok_name} {system} x{procs}: {describe_prep(r)}", started)
    return {"bpe": bpe, "tokenizers": list(tokenizers), "runs": runs}


def bench_startup(args: argparse.Namespace, work: Path, corpora: dict[str, dict], started: float) -> dict[str, Any]:
    """Part 2: per corpus, a cold preparation, ``--startup-reps`` timed train.py runs, a warm ``prepare()``; the
    largest ``data=text`` corpus profiled too."""
    plan = startup_corpora(args, corpora)
    largest = [c["label"] for c in plan if c["data"] == "text"][-1]
    out, cache, nan = [], work / "startup-cache", float("nan")
    for c in plan:
        label, spec = c["label"], c["spec"] | {"tokenizer": "byte"}
        prep = spawn(spec | {"kind": "xfam"}, cache, args)
        log(f"start-up {label}: cold preparation: {describe_prep(prep)}", started)
        overrides = ["trainer.max_steps=1", *SHORT_RUN, *c["overrides"]]
        runs: list[dict[str, Any]] = []
        for _ in range(args.startup_reps):
            runs.append(r := time_train(overrides, cache, args))
            ms = {k: r["milestones_s"].get(k, nan) for k in MILESTONES}
            log(
                f"start-up {label}: first step at {ms['step']:.2f} s (config done {ms['config']:.2f} s, data + model "
                f"{ms['data']:.2f} s), whole run {r['total_s']:.2f} s; others {r['foreign_cores']:.2f} cores",
                started,
            )
        warm = spawn(spec | {"kind": "warm", "profile": label == largest}, cache, args)
        stages = "  ".join(f"{k} {v:.2f}" for k, v in warm["stages"].items())
        log(f"start-up {label}: warm prepare() {warm['total_s']:.2f} s: {stages}", started)
        out.append({"label": label, "data": c["data"], **c["spec"], "prepare": prep, "runs": runs, "warm": warm})
        if label == largest and not args.quick:  # where the start-up of the largest corpus goes: under cProfile
            path = work / "train.prof"
            run = time_train(overrides, cache, args, profile=path)
            out[-1]["train_profile"] = train_profile(path) | {"total_s": run["total_s"]}
            path.unlink(missing_ok=True)
            calls = out[-1]["train_profile"]["functions"]
            log(
                f"start-up {label}: train.py under cProfile {run['total_s']:.1f} s; "
                + ", ".join(f"{r['label']} {r['calls']}x {r['cum_s']:.1f} s" for r in calls[:3]),
                started,
            )
    return {"overrides": ["trainer.max_steps=1", *SHORT_RUN], "hf_overrides": HF_OVERRIDES, "corpora": out}


def startup_corpora(args: argparse.Namespace, corpora: dict[str, dict]) -> list[dict[str, Any]]:
    """Part 2's corpora: label, ``data`` (text or hf), the worker spec of the source and its train.py overrides.
    The default corpus, part 1's, the big one, then the ``data=hf`` datasets of part 1's and the big one's text
    (quick: part 1's half corpus, the big one, its dataset)."""

    def text(label: str, c: dict | None) -> dict[str, Any]:
        paths = None if c is None else [c["root"]]
        overrides = [] if c is None else [f"data.paths=[{c['root']}]"]
        return {"label": label, "data": "text", "spec": {"paths": paths}, "overrides": overrides}

    def hf(label: str, c: dict) -> dict[str, Any]:
        overrides = [*HF_OVERRIDES, f"data.path={c['root']}"]
        return {"label": label + ", data=hf", "data": "hf", "spec": {"hf": c["root"]}, "overrides": overrides}

    small = (
        [text("half", corpora["half"])]
        if args.quick
        else [text("default (stdlib)", None), text("full", corpora["full"])]
    )
    hfs = [hf(name, corpora[f"hf {name}"]) for name in ("full", "big") if f"hf {name}" in corpora]
    return [*small, text("big", corpora["big"]), *hfs]


def bench_loader(args: argparse.Namespace, work: Path, corpora: dict[str, dict], started: float) -> dict[str, Any]:
    """Part 3: training tokens/s (train.py, default config) and the loader's, num_workers 0 and 2."""
    cache = work / "startup-cache"
    first = startup_corpora(args, corpora)[0]
    label, paths = first["label"], first["spec"]["paths"]
    train = time_train([f"trainer.max_steps={args.train_steps}", *SHORT_RUN, *first["overrides"]], cache, args)
    rate = train["metrics"].get("train/tokens_per_s")
    log(f"training ({label} corpus, {args.train_steps} steps): {rate:,.0f} tokens/s", started)
    spec = {"kind": "loader", "paths": paths, "num_workers": [0, 2], "warmup": 20}
    spec |= {"windows": args.loader_windows, "window_s": args.loader_window_s}
    res = spawn(spec, cache, args)
    loaders = [r | {"foreign_cores": res["foreign_cores"]} for r in res["loaders"]]
    for r in loaders:
        log(
            f"loader num_workers={r['num_workers']}: {r['tokens_per_s']:,.0f} tokens/s "
            f"({r['tokens_per_s'] / rate:,.0f}x training); others {r['foreign_cores']:.2f} cores",
            started,
        )
    return {"corpus": label, "train": train, "train_steps": args.train_steps, "loaders": loaders}


def meta(args: argparse.Namespace) -> dict[str, Any]:
    from importlib.metadata import version

    from benchlib import protocol

    ns = argparse.Namespace(threads=args.threads, quiet=None, max_wait=None, noisy=None, retries=None)
    m = protocol.machine_meta(ns)
    for key in ("quiet", "max_wait", "noisy", "retries", "x_transformers"):
        m.pop(key, None)
    versions = {name: version(name) for name in ("datasets", "tokenizers", "numpy", "pyarrow")}
    return m | {"versions": versions, "quick": args.quick, "quiet": args.quiet, "max_wait": args.max_wait}


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work / "startup-cache", ignore_errors=True)  # part 2 times a cold preparation first
    data: dict[str, Any] = {"meta": meta(args)}
    load_start, uptime_start = os.getloadavg(), _uptime()
    sizes = {"full": args.corpus_mb * MB, "half": args.corpus_mb * MB / 2, "big": args.big_gb * 1000 * MB}
    corpora: dict[str, dict] = {}
    for name, size in sizes.items():
        corpora[name] = c = build_corpus(work / f"corpus-{size / MB:g}mb", int(size))
        log(
            f"corpus {name}: {c['bytes'] / MB:,.1f} MB, {c['files']:,} files ({c['copies']} copies) in {c['root']}",
            started,
        )
    for name in (["big"] if args.quick else ["full", "big"]) if "startup" in args.parts else []:
        c = corpora[name]
        corpora[f"hf {name}"] = hf = build_hf_corpus(work / f"hf-{c['target_bytes'] / MB:g}mb", c, args.timeout)
        log(f"dataset hf {name}: {hf['bytes'] / MB:,.1f} MB in {hf['files']} Arrow files in {hf['root']}", started)
    data["corpora"] = corpora
    try:
        if "prepare" in args.parts:
            data["prepare"] = bench_prepare(args, work, corpora, started)
        if "startup" in args.parts:
            data["startup"] = bench_startup(args, work, corpora, started)
        if "loader" in args.parts:
            data["loader"] = bench_loader(args, work, corpora, started)
    finally:
        shutil.rmtree(work / "startup-cache", ignore_errors=True)
    data["meta"] |= {
        "wall_s": round(time.perf_counter() - started, 1),
        "loadavg": [round(load_start[0], 2), round(os.getloadavg()[0], 2)],
        "uptime": [uptime_start, _uptime()],
    }
    data["measured"] = {part: measured(data["meta"]) for part in args.parts}
    return data


def measured(meta: dict[str, Any]) -> dict[str, Any]:
    """What the report says of the run that measured a part: its date, commit, command, wall time, load."""
    return {k: meta[k] for k in ("date", "xfam_commit", "command", "wall_s", "loadavg")}


def keep_parts(data: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
    """``data`` with the parts it did not measure taken from the earlier results ``old``, each with the record of
    the run that measured it (``measured``)."""
    for part in PARTS:
        if part in old and part not in data:
            data[part] = old[part]
            data["measured"][part] = old.get("measured", {}).get(part) or measured(old["meta"])
    return data


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


PARTS = ("prepare", "startup", "loader")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus-mb", type=float, default=100, help="corpus of part 1, MB of text (default 100)")
    p.add_argument("--big-gb", type=float, default=1.0, help="big corpus of part 2, GB of text (default 1.0)")
    p.add_argument("--bpe-vocab", type=int, default=8192, help="vocabulary of the benchmark's BPE (default 8192)")
    p.add_argument("--bpe-train-mb", type=float, default=10, help="MB of the stdlib the BPE trains on (default 10)")
    p.add_argument("--prep-reps", type=int, default=1, help="runs per preparation system (default 1; medians)")
    p.add_argument("--startup-reps", type=int, default=3, help="train.py runs per corpus in part 2 (default 3)")
    p.add_argument("--train-steps", type=int, default=25, help="steps of the training-throughput run (default 25)")
    p.add_argument("--loader-windows", type=int, default=5, help="timed loader windows (default 5)")
    p.add_argument("--loader-window-s", type=float, default=1.0, help="seconds per loader window (default 1)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of train.py runs")
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated parts to run (default: all three)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per worker process (default 1800)")
    p.add_argument(
        "--quiet", type=float, default=0.3, help="before each measurement, wait until others use < this many cores"
    )
    p.add_argument("--max-wait", type=float, default=300, help="longest wait for --quiet, seconds (0: never wait)")
    p.add_argument(
        "--work",
        type=Path,
        default=Path(tempfile.gettempdir()) / "xfam_bench_data",
        help="corpora (kept, reused) and temp caches (removed) (default /tmp/xfam_bench_data)",
    )
    p.add_argument("--md", type=Path, default=None, help="report section's file (default docs/benchmarks.md)")
    p.add_argument("--png", type=Path, default=None, help="chart (default docs/benchmarks_data.png)")
    p.add_argument("--json", type=Path, default=None, help="also save the raw results here")
    p.add_argument("--from-json", type=Path, default=None, help="render the docs from saved raw results")
    p.add_argument("--keep-json", type=Path, default=None, help="take the parts not run from these raw results")
    p.add_argument("--no-docs", action="store_true", help="print the summary only; write no md/png")
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny corpora, no waiting (a check that everything runs, ~2 min); writes docs only with --md/--png",
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        worker_main(args.worker)
        return
    args.parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    if bad := [s for s in args.parts if s not in PARTS]:
        p.error(f"--parts: unknown part(s) {bad}; choose from {', '.join(PARTS)}")
    docs = not args.no_docs and (not args.quick or args.md is not None or args.png is not None)
    args.md = args.md or ROOT / "docs/benchmarks.md"
    args.png = args.png or ROOT / "docs/benchmarks_data.png"
    if args.quick:
        args.corpus_mb, args.big_gb, args.bpe_vocab, args.bpe_train_mb = 4.0, 0.006, 1024, 0.3
        args.startup_reps, args.train_steps, args.loader_windows, args.loader_window_s = 1, 4, 2, 0.3
        args.prep_reps, args.max_wait = 1, 0

    if args.from_json:
        data = json.loads(args.from_json.read_text())
    else:
        data = run_all(args)
        if args.keep_json:
            data = keep_parts(data, json.loads(args.keep_json.read_text()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=1))
    if docs:
        write_report(data, args.md, args.png)
        print(f"wrote {args.md} (section {START}) and {args.png}")
    print_summary(data)


if __name__ == "__main__":
    main()
