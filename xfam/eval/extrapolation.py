"""Length extrapolation: a causal LM's loss at evaluation lengths other than its training length.

The protocols are those of Press et al., 2022 ("Train Short, Test Long: Attention with Linear Biases
Enables Input Length Extrapolation", ALiBi, arXiv:2108.12409, sec. 2 and appendix B). A token
stream ``x_0 .. x_N`` gives N targets (``x_t`` predicted from tokens before it); an evaluation
length L is the longest input the model is given at once:

* ``nonoverlapping``: the inputs are cut into consecutive chunks of L, each scored from scratch
  (the paper's default). Every target is scored once, but a target early in its chunk sees little
  context, so the numbers mix "can the model run at length L" with "how much context it had".
* ``sliding``: windows of L inputs moved by a stride s. The first window scores all its targets;
  each later one scores only its last s targets, so every scored target after the first window
  has at least ``L - s`` tokens of context. The paper uses s = 1 (every target has ``L - 1``
  tokens of context; N forward passes of length L); a stride s costs about ``N L / s`` token
  evaluations instead of N. ``DEFAULT_STRIDE`` below is chosen for cost on a CPU.

The same N targets are scored at every L and by both protocols, so the numbers are directly
comparable; with ``s = L`` the sliding protocol is the non-overlapping one. Every window starts at
position 0, as in the paper.

Shapes: N scored targets, W windows, B windows per batch, L evaluation length, V vocabulary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xfam.core import plugins
from xfam.core.errors import ConfigError

Protocol = Literal["nonoverlapping", "sliding"]
PROTOCOLS: tuple[str, ...] = ("nonoverlapping", "sliding")
#: Sliding-window stride when none is given: 32 tokens. Every scored target then has at least
#: L - 32 tokens of context (half the context at L = 64, 97% of it at L = 1024) for L / 32 times
#: the work of the non-overlapping protocol; the paper's stride 1 would cost L times.
DEFAULT_STRIDE = 32
#: Tokens per forward batch (windows of length L are batched max(1, BATCH_TOKENS // L) at a time).
BATCH_TOKENS = 4096


@dataclasses.dataclass(frozen=True)
class Window:
    """Inputs ``stream[start:end]``; the targets of inputs ``score_from .. end - 1`` are scored."""

    start: int
    end: int
    score_from: int


@dataclasses.dataclass
class LengthResult:
    """What one (length, protocol) evaluation measured. ``nll`` is the mean over targets in nats,
    ``ppl = exp(nll)``, ``bpb`` bits per byte when the data maps tokens to bytes."""

    length: int
    protocol: str
    stride: int | None
    tokens: int
    windows: int
    nll: float
    ppl: float
    bpb: float | None
    seconds: float


def length_problem(model: nn.Module, length: int, setting: str | None = None) -> str | None:
    """Why ``model`` cannot take inputs of ``length`` tokens at once (None when it can): a bounded ``pos``
    (``pos=learned``) has one trained vector per position, a table of ``model.max_len`` rows, so a longer
    input has positions without a vector. Shared by every length evaluation (``evaluate_checkpoint``,
    ``xfam eval seq_len=N``), so a refusal is found before any data is read. ``setting``: how the message
    names the length (default ``evaluation length N``)."""
    pos, spec = getattr(model, "pos", None), getattr(model, "spec", None)
    if pos is None or spec is None or not pos.bounded or length <= spec.max_len:
        return None
    from xfam.pos import POS

    tableless = [n for n, c in POS.items() if not c.bounded and c.relative and plugins.is_builtin(c)]
    memory = ", or a longer mem_len (a memory model's context beyond a segment is its memory)"
    setting = setting or f"evaluation length {length}"
    return (
        f"{setting}: pos={pos.registry_name} has one trained vector per position, a table of {spec.max_len} rows "
        f"(model.max_len), so position {length - 1} is past the learned table "
        f"({spec.max_len} positions). Fix: a length of at most {spec.max_len}"
        f"{memory if getattr(model, 'uses_memory', False) else ''}; a model that is to run longer than it was "
        f"trained needs a pos without a table, e.g. pos in [{', '.join(tableless)}]."
    )


def windows(n: int, length: int, protocol: Protocol, stride: int | None = None) -> list[Window]:
    """The windows that score each of the ``n`` targets exactly once (see the module docstring).

    Targets are indexed by their input position ``t`` in ``0 .. n - 1`` (target ``x_{t+1}``).
    ``stride`` is used by ``sliding`` only (default ``DEFAULT_STRIDE``, at most ``length``).
    """
    if n < 1 or length < 1:
        raise ConfigError(f"need at least one target and a positive length (n={n}, length={length}).")
    if protocol == "nonoverlapping":
        return [Window(a, min(a + length, n), a) for a in range(0, n, length)]
    if protocol != "sliding":
        raise ConfigError(f"unknown protocol {protocol!r}; valid: {', '.join(PROTOCOLS)}.")
    s = DEFAULT_STRIDE if stride is None else stride
    if not 1 <= s <= length:
        raise ConfigError(f"stride={s} must lie in 1..length={length}. Fix: a stride between 1 and the length.")
    out = [Window(0, min(length, n), 0)]
    while out[-1].end < n:
        end = min(out[-1].end + s, n)
        out.append(Window(end - length, end, out[-1].end))
    return out


def _batches(wins: list[Window], batch_tokens: int) -> Iterator[list[Window]]:
    """Windows grouped by input length, ``max(1, batch_tokens // length)`` per group."""
    by_len: dict[int, list[Window]] = {}
    for w in wins:
        by_len.setdefault(w.end - w.start, []).append(w)
    for size, group in by_len.items():
        per = max(1, batch_tokens // size)
        for i in range(0, len(group), per):
            yield group[i : i + per]


def _logits(model: nn.Module, ids: Tensor) -> Tensor:
    out = model(ids)
    return out.logits if hasattr(out, "logits") else out


@torch.no_grad()
def token_nll(
    model: nn.Module,
    stream: Tensor,
    length: int,
    protocol: Protocol = "sliding",
    stride: int | None = None,
    *,
    batch_tokens: int = BATCH_TOKENS,
    progress: bool = True,
) -> Tensor:
    """Per-target NLL (nats) ``[N]`` of ``stream [N + 1]`` (target t is ``stream[t + 1]``) for a causal
    LM given at most ``length`` inputs at once. The model is put in eval mode; it is called as
    ``model(ids [B, L])`` and must return logits ``[B, L, V]`` (or an output with ``.logits``).

    A ``ConfigError`` raised by the model (e.g. ``pos=learned`` past its table) is raised again
    with the evaluation length in front of its message.
    """
    model.eval()
    n = stream.numel() - 1
    wins = windows(n, length, protocol, stride)
    device = next((p.device for p in model.parameters()), stream.device)
    stream = stream.to(device=device, dtype=torch.long)
    nll = torch.full((n,), math.nan, dtype=torch.float64, device=device)
    desc = f"L={length} {protocol}" + (f" s={stride or DEFAULT_STRIDE}" if protocol == "sliding" else "")
    with _progress(progress and len(wins) > 1, desc, len(wins)) as advance:
        for group in _batches(wins, batch_tokens):
            size = group[0].end - group[0].start
            starts = torch.tensor([w.start for w in group], device=device)  # [B]
            idx = starts[:, None] + torch.arange(size, device=device)  # [B, L]
            ids, targets = stream[idx], stream[idx + 1]  # [B, L] each
            try:
                logits = _logits(model, ids)  # [B, L, V]
            except ConfigError as err:
                raise ConfigError(f"evaluation length {length} ({protocol}): {err}") from err
            tok = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")  # [B * L]
            tok = tok.view(len(group), size)  # [B, L]
            for row, w in enumerate(group):
                nll[w.score_from : w.end] = tok[row, w.score_from - w.start :].double()
            advance(len(group))
    if torch.isnan(nll).any():  # each target is scored exactly once by construction; NaN here is a bug
        raise RuntimeError(f"{int(torch.isnan(nll).sum())} targets were not scored (or the model gave NaN).")
    return nll.cpu()


@contextlib.contextmanager
def _progress(enabled: bool, desc: str, total: int) -> Iterator[Callable[[int], None]]:
    """A transient rich progress bar over windows (or nothing); yields ``advance(k)``."""
    if not enabled:
        yield lambda k: None
        return
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task(desc, total=total)
        yield lambda k: bar.advance(task, k)


def evaluate_length(
    model: nn.Module,
    stream: Tensor,
    length: int,
    protocol: Protocol = "sliding",
    stride: int | None = None,
    *,
    token_bytes: Tensor | list[int] | None = None,
    batch_tokens: int = BATCH_TOKENS,
    progress: bool = True,
) -> LengthResult:
    """Mean NLL, perplexity and (with ``token_bytes [V]``) bits per byte of the targets of ``stream``
    at evaluation length ``length`` under ``protocol`` (see ``token_nll``)."""
    start = time.perf_counter()
    nll = token_nll(model, stream, length, protocol, stride, batch_tokens=batch_tokens, progress=progress)
    total = float(nll.sum())
    bpb = None
    if token_bytes is not None and len(token_bytes):
        n_bytes = float(torch.as_tensor(token_bytes)[stream[1:].long().cpu()].sum())
        bpb = total / math.log(2) / n_bytes if n_bytes else None
    used = (stride or DEFAULT_STRIDE) if protocol == "sliding" else None
    return LengthResult(
        length=length,
        protocol=protocol,
        stride=used,
        tokens=nll.numel(),
        windows=len(windows(nll.numel(), length, protocol, stride)),
        nll=total / nll.numel(),
        ppl=math.exp(total / nll.numel()),
        bpb=bpb,
        seconds=time.perf_counter() - start,
    )


def split_stream(source: Any, split: str, tokens: int) -> Tensor:
    """The first ``tokens + 1`` tokens ``[tokens + 1]`` of a prepared packed-LM split's stream (its rows
    overlap by one token, so the stream is row 0 followed by every later row but its first token)."""
    rows = source.split(split)["tokens"]  # [R, S + 1], consecutive pieces of one stream
    width = source.seq_len
    need = -(-tokens // width)  # rows that hold tokens + 1 stream tokens
    if not getattr(source, "contiguous", False) or len(rows) < need:
        raise ConfigError(
            f"the {split} split holds {len(rows) * width} contiguous tokens (contiguous rows: "
            f"{getattr(source, 'contiguous', False)}); {tokens} were asked for. Fix: fewer tokens, or more data."
        )
    block = rows[:need].long()  # [need, S + 1]
    stream = torch.cat((block[0], block[1:, 1:].reshape(-1)))
    return stream[: tokens + 1]


def evaluate_checkpoint(
    ckpt: str | Path,
    lengths: list[int],
    protocols: list[str],
    *,
    stride: int | None = None,
    tokens: int = 16384,
    split: str = "test",
    batch_tokens: int = BATCH_TOKENS,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Every (protocol, length) evaluation of a checkpoint on the first ``tokens`` targets of ``split``.

    Returns one dict per pair: the fields of ``LengthResult``, or ``{"length", "protocol",
    "refused": message}`` when the model refuses the length (``length_problem``, e.g. learned positions
    past ``model.max_len``, or a ``ConfigError`` the model raises); other errors propagate.
    """
    from xfam.model.build import build_data
    from xfam.model.checkpoint import load_model

    for protocol in protocols:  # a bad setting of the evaluation itself is an error, not a refusal
        windows(max(lengths), min(lengths), protocol, stride)  # type: ignore[arg-type]
    model, meta = load_model(ckpt)
    if meta["data_info"].get("task") != "lm" or not model.causal:
        raise ConfigError(f"{ckpt} is not a causal language model; length extrapolation needs one.")
    source = build_data(meta["config"])
    source.prepare()
    stream = split_stream(source, split, tokens)
    token_bytes = meta["data_info"].get("token_bytes")
    out: list[dict[str, Any]] = []
    for protocol in protocols:
        for length in lengths:
            if (why := length_problem(model, length)) is not None:
                out.append({"length": length, "protocol": protocol, "refused": why})
                continue
            try:
                res = evaluate_length(
                    model,
                    stream,
                    length,
                    protocol,  # type: ignore[arg-type]
                    stride,
                    token_bytes=token_bytes,
                    batch_tokens=batch_tokens,
                    progress=progress,
                )
            except ConfigError as err:
                out.append({"length": length, "protocol": protocol, "refused": str(err)})
                continue
            out.append(dataclasses.asdict(res))
    return out
