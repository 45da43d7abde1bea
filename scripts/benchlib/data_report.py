"""Report side of scripts/bench_data.py: the tables and prose of its section of docs/benchmarks.md, the chart
docs/benchmarks_data.png and the printed summary, all from the raw results (``--json``, ``--from-json``).

One file over 400 lines: the three parts' tables, prose and chart panels share their summaries (``prep_rows``,
``startup_summary``, ``growth``) and make one section, whose every sentence is computed from the numbers."""

from __future__ import annotations

import os
import re
import statistics
from pathlib import Path
from typing import Any

from benchlib import common

START, END = "<!-- bench:data:start -->", "<!-- bench:data:end -->"
HEADING = "## Data at scale: preparation, start-up, loader"
MB = 1e6  # text sizes in MB = 10^6 bytes (as xfam's log line)
#: train.py overrides for the shortest run: no validation, no test, no extra checkpoints or plots.
SHORT_RUN = [
    "test=false",
    "trainer.limit_val_batches=0",
    "callbacks.save_best=false",
    "callbacks.loss_curve=false",
    "callbacks.lr_monitor=false",
]
FIRST_STEP = re.compile(r"\bstep 1/\d+")
MILESTONES = {"config": re.compile(r"\ballocator: "), "data": re.compile(r"\bloader\.streams="), "step": FIRST_STEP}


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def describe_prep(r: dict[str, Any]) -> str:
    """One preparation result in a log line."""
    mb = r["text_bytes"] / MB
    return (
        f"{mb:,.1f} MB, {r['tokens'] / 1e6:,.1f} M tokens: reading {r['reading_s']:.1f} s, tokenising "
        f"{r['tokenising_s']:.1f} s ({mb / r['tokenising_s']:,.1f} MB/s, {r['tokens'] / 1e6 / r['tokenising_s']:,.2f} "
        f"M tokens/s), end to end {r['total_s']:.1f} s; peak RSS {r['memory']['peak_rss_mb']:,.0f} MB (largest child "
        f"{r['memory']['children_peak_rss_mb']:,.0f}), tree PSS {r['memory']['peak_pss_mb']:,.0f} MB; others "
        f"{r['foreign_cores']:.2f} cores"
    )


def prep_rows(data: dict[str, Any], corpus: str = "full") -> list[dict[str, Any]]:
    """Part 1's runs on ``corpus``, the median of repetitions per (tokenizer, system, processes), in run order."""
    groups: dict[tuple, list[dict]] = {}
    for r in data["prepare"]["runs"]:
        if r["corpus"] == corpus:
            groups.setdefault((r["tokenizer"], r["system"], r["num_proc"]), []).append(r)
    rows = []
    for (tok, system, procs), rs in groups.items():
        row = {"tokenizer": tok, "system": system, "num_proc": procs, "reps": len(rs)}
        for k in ("reading_s", "tokenising_s", "total_s", "foreign_cores"):
            row[k] = median([r[k] for r in rs])
        row |= {k: rs[0][k] for k in ("text_bytes", "tokens")}
        row["memory"] = {k: max(r["memory"][k] for r in rs) for k in rs[0]["memory"]}
        rows.append(row)
    return rows


def memory_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """xfam num_proc=2 peak memory by corpus size: part 1's half and full corpora, part 2's big one (byte)."""
    out = []
    if "prepare" in data:
        for corpus in ("half", "full"):
            for r in prep_rows(data, corpus):
                if r["system"] == "xfam" and r["num_proc"] == 2:
                    out.append(r | {"corpus": corpus})
    if "startup" in data:
        for c in data["startup"]["corpora"]:
            if c["label"] == "big":
                out.append(c["prepare"] | {"corpus": "big", "tokenizer": "byte", "num_proc": "all cores"})
    return sorted(out, key=lambda r: (r["tokenizer"], r["text_bytes"]))


def startup_summary(c: dict[str, Any]) -> dict[str, Any]:
    """Medians over the runs of one corpus: each milestone, the whole run."""
    ms = lambda k: [r["milestones_s"][k] for r in c["runs"] if k in r["milestones_s"]]  # noqa: E731
    return {k: ms(k) for k in MILESTONES} | {"total": [r["total_s"] for r in c["runs"]]}


def _kind(c: dict[str, Any]) -> str:
    return c.get("data", "text")


def growth(corpora: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    """Start-up growth of the ``kind`` (text or hf) corpora from the smallest to the largest: text GB and files
    added, seconds to the first step and of the warm ``prepare()``, each warm stage's, the stage that grew most,
    and the largest min-max spread of the two corpora's first steps."""
    cs = [c for c in corpora if _kind(c) == kind]
    if len(cs) < 2:
        return None
    a, b = cs[0], cs[-1]
    steps = [startup_summary(c)["step"] for c in (a, b)]
    deltas = {k: b["warm"]["stages"][k] - a["warm"]["stages"][k] for k in b["warm"]["stages"]}
    stage = max(deltas, key=deltas.get)
    return {
        "from": a["label"],
        "to": b["label"],
        "gb": (b["prepare"]["text_bytes"] - a["prepare"]["text_bytes"]) / 1e9,
        "files": (a["prepare"]["files"], b["prepare"]["files"]),
        "step_s": median(steps[1]) - median(steps[0]),
        "spread_s": max((max(x) - min(x) for x in steps if x), default=0.0),
        "warm_s": b["warm"]["total_s"] - a["warm"]["total_s"],
        "stage": stage,
        "stage_s": deltas[stage],
        "deltas": deltas,
    }


STAGE_LABELS = {
    "discover": "`discover`",
    "read_hash": "rest of `documents()` (text: a stat per file, its sha256 remembered by `FileFacts`, the split "
    "assignment; hf: `load_from_disk`, the carving)",
    "documents_cache": "documents cache: load + check (`cached_generate`)",
    "doc_bytes": "`doc_bytes`",
    "tokenizer": "`build_tokenizer`",
    "shards": "shards: index + checks (`prepare_split`)",
    "other": "other",
}
DISCOVER_NOTE = " (walk the folders; in parentheses: a second call in the process, the walk kept)"
SYSTEM_LABELS = {
    "xfam": "xfam `TextSource.prepare()`",
    "datasets.map": "`datasets` `Dataset.map`",
    "plain loop": "plain loop (read, encode, `np.save`)",
}


def _plural(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def _s(xs: list[float]) -> str:
    """Median (min-max) seconds."""
    if not xs:
        return "-"
    return f"{median(xs):.2f}" + (f" ({min(xs):.2f}-{max(xs):.2f})" if len(xs) > 1 else "")


def _mem(m: dict[str, float]) -> str:
    """Peak RSS of the process / of its largest child ("-": it had none)."""
    child = m["children_peak_rss_mb"]
    return f"{m['peak_rss_mb']:,.0f} / " + (f"{child:,.0f}" if child else "-")


def render_prepare(data: dict[str, Any]) -> list[str]:
    p, c = data["prepare"], data["corpora"]["full"]
    bpe = p["bpe"]
    reps = max(r["reps"] for r in prep_rows(data))
    out = [
        "### Preparation throughput",
        "",
        f"Corpus: {c['bytes'] / MB:,.1f} MB of text, {c['files']:,} files (the standard library's `*.py`, "
        f"{_plural(c['copies'], 'copy', 'copies')}, each file's copy k starting with `# copy k`), read once before "
        "(page cache). "
        f"Tokenizers: `byte` and `{p['tokenizers'][1]}`, a GPT-2-style byte-level BPE `tokenizer.json` "
        f"(vocabulary {bpe['vocab']:,}, trained with `tokenizers` on the first {bpe['train_mb']} MB of the standard "
        f"library in {bpe['train_s']:.1f} s) passed as `tokenizer=<path>`. Each row: a fresh subprocess on a fresh "
        "`HF_DATASETS_CACHE`, `TOKENIZERS_PARALLELISM=false` (one core per process)"
        + (f", median of {reps} runs." if reps > 1 else ", one run."),
        "",
        "| tokenizer | system | processes | reading (s) | tokenising (s) | tokenising MB/s | tokenising M tokens/s "
        "| end to end (s) | end-to-end MB/s | peak RSS: process / largest child (MB) | peak PSS of the process "
        "tree (MB; anonymous) | others' load (cores) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in prep_rows(data):
        mb, m = r["text_bytes"] / MB, r["memory"]
        out.append(
            f"| {r['tokenizer']} | {SYSTEM_LABELS[r['system']]} | {r['num_proc']} | {r['reading_s']:.1f} | "
            f"{r['tokenising_s']:.1f} | **{mb / r['tokenising_s']:,.1f}** | "
            f"{r['tokens'] / 1e6 / r['tokenising_s']:,.2f} "
            f"| {r['total_s']:.1f} | {mb / r['total_s']:,.1f} | {_mem(m)} | {m['peak_pss_mb']:,.0f}; "
            f"{m['peak_anon_pss_mb']:,.0f} | {r['foreign_cores']:.2f} |"
        )
    out += [
        "",
        "* *Reading* is the documents stage before any tokenising. xfam and `datasets.map`: "
        "`TextSource.documents()` (walk the folder, read and sha256 every file, write the documents to an Arrow "
        "cache with `Dataset.from_generator`); the plain loop: `Path.read_bytes()` of each file. "
        "*Tokenising*: xfam's `xfam.data.shards.run_jobs` (the stage of its `tokenize <split>` log line, timed by "
        "a wrapper: encode, write the `uint16`/`uint32` shards and their records; the three splits); "
        "`Dataset.map(batched=True, batch_size=256)` of the same tokenizer's `encode_docs` + eos into an `ids` "
        "column of Arrow cache files; the plain loop's encode + append + `np.concatenate` + `np.save`. "
        "*End to end*: xfam's whole `prepare()` (also the tokenizer load, the checks and the index); the others: "
        "reading + tokenising. MB/s = text bytes of all splits (MB = 10^6 bytes) / seconds.",
        "* Peak RSS: `getrusage` max RSS of the worker (`RUSAGE_SELF`, Python, torch and the libraries included) and "
        "of its largest child (`RUSAGE_CHILDREN`: the forked tokenising processes). RSS counts the file pages a "
        "process maps (the documents' Arrow cache, read by `datasets` through `mmap`) and the pages a forked child "
        "shares with its parent; the PSS of the whole process tree (sampled every 50 ms) counts a shared page "
        "once, and its anonymous part leaves out the file pages, which the kernel can drop.",
    ]
    return out


def render_memory(data: dict[str, Any]) -> list[str]:
    rows = memory_rows(data)
    if not rows:
        return []
    out = [
        "",
        "### Peak memory against corpus size (xfam, 2 processes)",
        "",
        "| tokenizer | corpus (MB of text) | tokens (M) | peak RSS: process / largest child (MB) | after imports (MB) "
        "| peak PSS of the tree (MB) | of which anonymous (MB) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        m = r["memory"]
        out.append(
            f"| {r['tokenizer']} | {r['text_bytes'] / MB:,.1f} | {r['tokens'] / 1e6:,.1f} | {_mem(m)} | "
            f"{m['baseline_rss_mb']:,.0f} | {m['peak_pss_mb']:,.0f} | {m['peak_anon_pss_mb']:,.0f} |"
        )
    out += [
        "",
        "The largest corpus is part 2's big one (its cold preparation, byte tokenizer, `num_proc` = every core = 2).",
    ]
    byte = [r for r in rows if r["tokenizer"] == "byte"]
    if len(byte) >= 2:
        a, b = byte[0], byte[-1]
        ma, mb = a["memory"], b["memory"]
        out[-1] += (
            f" From {a['text_bytes'] / MB:,.0f} to {b['text_bytes'] / MB:,.0f} MB of text "
            f"({b['text_bytes'] / a['text_bytes']:.0f}x) the anonymous memory of the process tree goes from "
            f"{ma['peak_anon_pss_mb']:,.0f} to {mb['peak_anon_pss_mb']:,.0f} MB and its whole PSS from "
            f"{ma['peak_pss_mb']:,.0f} to {mb['peak_pss_mb']:,.0f} MB: the difference is file pages of the "
            "memory-mapped documents cache (and of the shards being written), which the kernel reclaims under "
            "memory pressure; RSS counts them too (the largest child's: "
            f"{ma['children_peak_rss_mb']:,.0f} and {mb['children_peak_rss_mb']:,.0f} MB)."
        )
    return out


def render_startup(data: dict[str, Any]) -> list[str]:
    s = data["startup"]
    cs, reps = s["corpora"], len(s["corpora"][0]["runs"])
    hf = " ".join(s.get("hf_overrides", [])) + " data.path=<folder>"
    out = [
        "",
        "### Start-up after preparation",
        "",
        "`python train.py [data.paths=[corpus]] " + " ".join(s["overrides"]) + "` (byte tokenizer, the tiny "
        f"default model) after one preparation; {_plural(reps, 'run')} per corpus"
        + (", medians (min-max)" if reps > 1 else "")
        + ". Seconds from the process "
        "start to the log line `step 1/1` (the first step done), and to two lines before it: `allocator: ...` "
        "(imports, config and its checks done) and `loader.streams=...` (data prepared and model built)."
        + (
            f" The data=hf rows run `{hf}` on a `save_to_disk` folder of one `text` column holding the text corpus "
            "of the same name, a row per file: the same bytes in a few large Arrow files instead of many small "
            "files (validation and test carved from train by a seeded permutation of the rows)."
            if any(_kind(c) == "hf" for c in cs)
            else ""
        ),
        "",
        "| corpus | text (MB) | files (hf: Arrow files) | tokens (M) | shards | cold preparation (s) | **to the first "
        "step (s)** | imports + config (s) | + data + model (s) | whole run (s) | warm `prepare()` alone (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cs:
        p, st = c["prepare"], startup_summary(c)
        out.append(
            f"| {c['label']} | {p['text_bytes'] / MB:,.1f} | {p['files']:,} | {p['tokens'] / 1e6:,.1f} | "
            f"{p['shards']} | {p['total_s']:.1f} | **{_s(st['step'])}** | {_s(st['config'])} | {_s(st['data'])} | "
            f"{_s(st['total'])} | {c['warm']['total_s']:.2f} |"
        )
    keys = list(STAGE_LABELS)
    out += [
        "",
        "Warm `prepare()` of each source in a subprocess, by stage (seconds; the time in wrapped functions, and what "
        "is left of `documents()` once `discover` and `cached_generate` are taken out; -: not a stage of data=hf):",
        "",
        "| corpus | " + " | ".join(STAGE_LABELS[k] + DISCOVER_NOTE * (k == "discover") for k in keys) + " | total |",
        "|---|" + "---:|" * (len(keys) + 1),
    ]
    out += [
        f"| {c['label']} | " + " | ".join(_stage(c, k) for k in keys) + f" | {c['warm']['total_s']:.2f} |" for c in cs
    ]
    out += _render_growth(cs) + _render_train_profile(next((c for c in cs if c.get("train_profile")), None))
    big = next((c for c in cs if c["warm"].get("profile")), None)
    if big is not None:
        out += [
            "",
            f"cProfile of the warm `prepare()` of the {big['label']} corpus (a second `prepare()` in the same "
            "process: its `discover` finds the walk kept), the functions with the most own time:",
            "",
            "| function | calls | own (s) | cumulative (s) |",
            "|---|---:|---:|---:|",
        ]
        out += [
            f"| `{r['function']}` | {r['calls']:,} | {r['own_s']:.2f} | {r['cum_s']:.2f} |"
            for r in big["warm"]["profile"]
        ]
    return out


def _stage(c: dict[str, Any], key: str) -> str:
    """One cell of the warm-stage table: seconds; ``discover`` with its second call; "-" where hf has no such stage."""
    if _kind(c) == "hf" and key in ("discover", "documents_cache"):
        return "-"
    again = c["warm"].get("discover_again_s") if key == "discover" else None
    return f"{c['warm']['stages'][key]:.2f}" + (f" ({again:.2f})" if again is not None else "")


def _flat(g: dict[str, Any]) -> bool:
    """Whether a growth's change of the first step is within the spread of its runs."""
    return abs(g["step_s"]) <= g["spread_s"]


def _render_growth(cs: list[dict[str, Any]]) -> list[str]:
    """What grows from the smallest to the largest corpus of each kind, and whether it is the files or the bytes."""
    out, gs = [], {kind: growth(cs, kind) for kind in ("text", "hf")}
    for kind, g in gs.items():
        if g is not None:
            per_gb = g["step_s"] / g["gb"] if g["gb"] > 0 else float("nan")
            out += [
                "",
                f"data={kind}, from *{g['from']}* to *{g['to']}* (+{g['gb']:.2f} GB of text; {g['files'][0]:,} to "
                f"{g['files'][1]:,} {'files' if kind == 'text' else 'Arrow files'}): the first step moves by "
                f"{g['step_s']:+.2f} s ({per_gb:+.2f} s per GB; the runs of one corpus spread over up to "
                f"{g['spread_s']:.2f} s) and the warm `prepare()` by {g['warm_s']:+.2f} s; the stage that grows most: "
                f"{STAGE_LABELS[g['stage']]}, {g['stage_s']:+.2f} s.",
            ]
    text, hf = gs["text"], gs["hf"]
    if text is None or hf is None:
        return out
    t, h = ([c for c in cs if _kind(c) == kind][-1] for kind in ("text", "hf"))
    st, sh = (median(startup_summary(c)["step"]) for c in (t, h))
    per = lambda k: text["deltas"][k] / max(text["files"][1] - text["files"][0], 1) * 1e4  # noqa: E731
    out += [
        "",
        ("Files, not bytes: " if _flat(hf) and not _flat(text) else "Files and bytes: ")
        + f"the same {h['prepare']['text_bytes'] / 1e9:.2f} GB reaches the first step at {sh:.2f} s as "
        f"{h['prepare']['files']} Arrow files (data=hf) and at {st:.2f} s as {t['prepare']['files']:,} files "
        f"(data=text). Per 10,000 files added, data=text's warm `discover` (a first call) grows by "
        f"{per('discover'):+.2f} s and the rest of its `documents()` by {per('read_hash'):+.2f} s; with the bytes "
        f"alone (data=hf, +{hf['gb']:.2f} GB) the first step moves by {hf['step_s']:+.2f} s, "
        + ("within" if _flat(hf) else "beyond")
        + f" the spread of the runs, and the warm `prepare()` by {hf['warm_s']:+.2f} s (most in "
        f"{STAGE_LABELS[hf['stage']]}, {hf['stage_s']:+.2f} s).",
    ]
    return out


def _callers(counts: dict[str, int]) -> str:
    return ", ".join(f"{n}x from `{where}`" for where, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def _render_train_profile(c: dict[str, Any] | None) -> list[str]:
    """The table of a train.py start-up under cProfile (of corpus ``c``, if any), with who calls ``discover``."""
    if c is None:
        return []
    prof = c["train_profile"]
    st = startup_summary(c)
    out = [
        "",
        f"One more `train.py` run of the {c['label']} corpus under cProfile ({prof['total_s']:.1f} s, against "
        f"{median(st['total']):.1f} s unprofiled: the profiler slows Python calls), cumulative seconds:",
        "",
        "| what | function | calls | cumulative (s, profiled) |",
        "|---|---|---:|---:|",
    ]
    out += [f"| {r['label']} | `{r['function']}` | {r['calls']:,} | {r['cum_s']:.2f} |" for r in prof["functions"]]
    calls = prof["callers"]
    if "discover" in calls:
        n = sum(calls["discover"].values())
        out += ["", f"`discover` is called {n} times: {_callers(calls['discover'])}"]
        if "check" in calls:
            out[-1] += f"; `TextSource.check`: {_callers(calls['check'])}"
        if "validate" in calls:
            out[-1] += f"; `validate`: {_callers(calls['validate'])}"
        once, again = c["warm"]["stages"]["discover"], c["warm"]["discover_again_s"]
        out[-1] += (
            f". Unprofiled, the first `discover` of this corpus in a process takes {once:.2f} s and a later one "
            f"{again:.2f} s (the warm `prepare()` above), so a start-up spends about {once:.2f} + {n - 1} x "
            f"{again:.2f} = {once + (n - 1) * again:.1f} s finding the files."
        )
    return out


def render_loader(data: dict[str, Any]) -> list[str]:
    ld = data["loader"]
    rate = ld["train"]["metrics"].get("train/tokens_per_s") or float("nan")
    m = data["meta"]
    out = [
        "",
        "### Loader throughput vs training",
        "",
        f"Corpus: {ld['corpus']}; batch {ld['loaders'][0]['batch_shape'][0]} x {ld['loaders'][0]['batch_shape'][1]} "
        f"(the default). Training: `python train.py trainer.max_steps={ld['train_steps']} "
        + " ".join(SHORT_RUN)
        + f"` (default config: `model=tiny`, {m['threads']} torch threads), `train/tokens_per_s` of its "
        "`metrics.json` (the `Throughput` callback's median over the steps after 3 warm-up steps). Loader: "
        "`XfamDataModule(source, seed=0, num_workers=n).train_dataloader()` iterated without a model (1 torch "
        f"thread), the median of {len(ld['loaders'][0]['windows'])} windows of ~1 s after 20 batches.",
        "",
        "| | tokens/s | loader / training |",
        "|---|---:|---:|",
        f"| training, default model (train.py) | {rate:,.0f} | 1 |",
    ]
    for r in ld["loaders"]:
        tokens = r["tokens_per_s"]
        out.append(f"| loader, `num_workers={r['num_workers']}` | {tokens:,.0f} | **{tokens / rate:,.0f}x** |")
    ratio = ld["loaders"][0]["tokens_per_s"] / rate
    main, workers = ld["loaders"][0], ld["loaders"][-1]
    out += [
        "",
        f"Target: the loader at least 20x faster than training (loading under 5 % of a step): "
        f"{'met' if ratio >= 20 else 'NOT met'} in the main process ({ratio:,.0f}x)."
        + (
            f" Workers make it slower here ({workers['tokens_per_s'] / main['tokens_per_s']:.2f}x the main process's "
            "rate): a row is a copy out of the memory-mapped shards, cheaper than sending each batch from a worker "
            "process through a queue, so `loader.num_workers=0` (the default) is the faster setting for `data=text` on "
            "this machine."
            if workers["tokens_per_s"] < main["tokens_per_s"]
            else ""
        ),
    ]
    return out


PART_NAMES = {
    "prepare": "preparation throughput and memory (its largest row: with the start-up)",
    "startup": "start-up",
    "loader": "loader vs training",
}


def runs_of(data: dict[str, Any]) -> list[tuple[list[str], dict[str, Any]]]:
    """The runs that measured the parts of ``data``: (its parts, its ``measured`` record), in part order."""
    records = {p: data.get("measured", {}).get(p, data["meta"]) for p in PART_NAMES if p in data}
    groups: list[tuple[list[str], dict[str, Any]]] = []
    for part, record in records.items():
        same = next((parts for parts, r in groups if r == record), None)
        if same is None:
            groups.append(([part], record))
        else:
            same.append(part)
    return groups


def _run_line(m: dict[str, Any]) -> str:
    return (
        f"on {m['date']} (`{m['command']}`, {m['wall_s'] / 60:.0f} min; 1-minute load average {m['loadavg'][0]:.1f} "
        f"at the start, {m['loadavg'][1]:.1f} at the end), xfam at commit {m['xfam_commit']}"
    )


def render_md(data: dict[str, Any], png: Path | None, md_path: Path) -> str:
    m, runs = data["meta"], runs_of(data)
    v = m["versions"]
    loads = [r["foreign_cores"] for r in _all_measurements(data)]
    waits = [r.get("waited_s", 0.0) for r in _all_measurements(data)]
    if len(runs) > 1:
        out = [f"Measured by `scripts/bench_data.py` in {len(runs)} runs on one machine:", ""]
        out += [f"* {', '.join(PART_NAMES[p] for p in parts)}: {_run_line(r)}." for parts, r in runs]
    else:
        out = [f"Measured by `scripts/bench_data.py` {_run_line(m)}.", ""]
    out += [
        "* Machine and versions"
        + " (of the latest run)" * (len(runs) > 1)
        + f": {m['cpu']}, {m['cores']} cores, {m['memory_gb']} GB; python "
        f"{m['python']}, torch {m['torch']}, lightning {m['lightning']}, datasets {v['datasets']}, tokenizers "
        f"{v['tokenizers']}, numpy {v['numpy']}, pyarrow {v['pyarrow']}.",
        f"* A shared machine: other processes used {median(loads):.2f} cores (median; max {max(loads):.2f}) while "
        "the measurements ran (the machine's busy time, /proc/stat, minus this benchmark's)"
        + (
            f"; each measurement started once they used under {m['quiet']} cores for 2 s, or after "
            f"{m['max_wait']:.0f} s of waiting ({sum(waits):.0f} s waited in all)"
            if m.get("max_wait")
            else ""
        )
        + ". Times are indicative.",
        "",
    ]
    if png is not None:
        out += [f"![data at scale]({os.path.relpath(png, md_path.parent)})", ""]
    if "prepare" in data:
        out += render_prepare(data) + render_memory(data)
    if "startup" in data:
        out += render_startup(data)
    if "loader" in data:
        out += render_loader(data)
    return "\n".join(out)


def _all_measurements(data: dict[str, Any]) -> list[dict[str, Any]]:
    out = list(data.get("prepare", {}).get("runs", []))
    for c in data.get("startup", {}).get("corpora", []):
        out += [c["prepare"], c["warm"], *c["runs"]]
    if "loader" in data:
        out += [data["loader"]["train"], *data["loader"]["loaders"]]
    return out or [{"foreign_cores": float("nan")}]


def render_png(data: dict[str, Any], path: Path) -> None:
    """Left: tokenising and end-to-end MB/s per system and tokenizer; middle: seconds to the first step against
    corpus size; right: loader vs training tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in ("prepare", "startup", "loader") if k in data]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.6), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        {"prepare": _png_prepare, "startup": _png_startup, "loader": _png_loader}[panel](ax, data)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _png_prepare(ax: Any, data: dict[str, Any]) -> None:
    rows = prep_rows(data)
    short = {"xfam": "xfam", "datasets.map": "map", "plain loop": "loop"}
    labels = [f"{r['tokenizer']}\n{short[r['system']]} x{r['num_proc']}" for r in rows]
    tok = [r["text_bytes"] / MB / r["tokenising_s"] for r in rows]
    e2e = [r["text_bytes"] / MB / r["total_s"] for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], tok, 0.4, color="C0", label="tokenising stage")
    ax.bar([i + 0.2 for i in x], e2e, 0.4, color="C1", label="end to end (with reading)")
    for i, (a, b) in enumerate(zip(tok, e2e)):
        ax.text(i - 0.2, a, f"{a:.0f}" if a >= 10 else f"{a:.1f}", ha="center", va="bottom", fontsize=6)
        ax.text(i + 0.2, b, f"{b:.0f}" if b >= 10 else f"{b:.1f}", ha="center", va="bottom", fontsize=6)
    ax.set_xticks(list(x), labels, fontsize=6)
    ax.set_yscale("log")
    ax.set_ylabel("MB of text per second")
    ax.set_title(f"Preparation, {data['corpora']['full']['bytes'] / MB:,.0f} MB corpus", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)


def _png_startup(ax: Any, data: dict[str, Any]) -> None:
    cs = data["startup"]["corpora"]
    for kind, marker in (("text", "o-"), ("hf", "^:")):
        ks = [c for c in cs if _kind(c) == kind]
        gb, summaries = [c["prepare"]["text_bytes"] / 1e9 for c in ks], [startup_summary(c) for c in ks]
        lines = [("step", "to the first step", "C3"), ("data", "to data + model ready", "C2")]
        lines += [("config", "to imports + config done", "C7")] if kind == "text" else []
        for key, label, color in lines:
            ax.plot(gb, [median(s[key]) for s in summaries], marker, color=color, label=f"data={kind}: {label}")
        if kind == "text":
            ax.plot(gb, [c["warm"]["total_s"] for c in ks], "s--", color="C4", label="data=text: warm prepare() alone")
            for g, c in zip(gb, ks):
                ax.annotate(c["label"], (g, 0), textcoords="offset points", xytext=(0, 4), fontsize=7, ha="center")
    ax.set_xscale("log")
    ax.set_xlabel("GB of text (byte tokenizer; log scale)")
    ax.set_ylabel("seconds after the process starts")
    ax.set_ylim(bottom=0)
    ax.set_title("Start-up of train.py after preparation", fontsize=9)
    ax.legend(fontsize=6, loc="upper left")
    ax.grid(alpha=0.3)


def _png_loader(ax: Any, data: dict[str, Any]) -> None:
    ld = data["loader"]
    rate = ld["train"]["metrics"].get("train/tokens_per_s") or float("nan")
    labels = ["training\n(tiny model)"] + [f"loader\nnum_workers={r['num_workers']}" for r in ld["loaders"]]
    vals = [rate] + [r["tokens_per_s"] for r in ld["loaders"]]
    ax.bar(range(len(vals)), vals, color=["C3", "C0", "C9"])
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:,.0f}" + (f"\n({v / rate:,.0f}x)" if i else ""), ha="center", va="bottom", fontsize=7)
    ax.axhline(20 * rate, color="k", ls=":", lw=1, label="20x training (target)")
    ax.set_xticks(range(len(vals)), labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("tokens per second")
    ax.set_title("Loader vs training, batch 16 x 256", fontsize=9)
    ax.set_ylim(top=max(vals) * 8)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(axis="y", alpha=0.3)


def write_report(data: dict[str, Any], md: Path, png: Path) -> None:
    """The chart and this benchmark's section of ``md`` (``benchlib.common.write_report``)."""
    chart = lambda path: render_png(data, path)  # noqa: E731
    common.write_report(md, png, (START, END), HEADING, chart, render_md(data, png, md))


def print_summary(data: dict[str, Any]) -> None:
    """The headline numbers of each part, on stdout."""
    for r in prep_rows(data) if "prepare" in data else []:
        mb = r["text_bytes"] / MB
        print(
            f"  {r['tokenizer']:<7} {r['system']:<13} x{r['num_proc']}  tokenising {mb / r['tokenising_s']:7.1f} MB/s  "
            f"end to end {mb / r['total_s']:7.1f} MB/s  peak RSS {_mem(r['memory'])} MB"
        )
    for r in memory_rows(data) if "prepare" in data else []:
        print(f"  memory {r['tokenizer']:<7} {r['text_bytes'] / MB:8.1f} MB of text: peak RSS {_mem(r['memory'])} MB")
    for c in data.get("startup", {}).get("corpora", []):
        print(
            f"  start-up {c['label']:<17} {c['prepare']['text_bytes'] / MB:8.1f} MB: first step "
            f"{_s(startup_summary(c)['step'])} s, warm prepare() {c['warm']['total_s']:.2f} s"
        )
    for g in (growth(data["startup"]["corpora"], kind) for kind in ("text", "hf")) if "startup" in data else []:
        if g is not None:
            print(
                f"  growth {g['from']} -> {g['to']}: first step {g['step_s']:+.2f} s, {g['stage']} "
                f"{g['stage_s']:+.2f} s"
            )
    if "loader" in data:
        rate = data["loader"]["train"]["metrics"].get("train/tokens_per_s") or float("nan")
        print(f"  training {rate:,.0f} tokens/s")
        for r in data["loader"]["loaders"]:
            tokens = r["tokens_per_s"]
            print(f"  loader num_workers={r['num_workers']}: {tokens:,.0f} tokens/s ({tokens / rate:,.0f}x)")
