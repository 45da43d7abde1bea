"""Generation from memory models: the memory is carried across segments as in training, so every
generated token's logits are those of the model re-run over the whole stream segment by segment
(Transformer-XL's recurrence, Dai et al., 2019, arXiv:1901.02860, sec. 3.2); every memory of
configs/memory generates; what cannot generate says why."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from doubles import build_model
from torch import Tensor, nn

from xfam.core.errors import ConfigError
from xfam.eval.generate import generate, stream_logits
from xfam.model.spec import ModelSpec
from xfam.model.transformer import XfamModel

V, SEG = 13, 4  # vocabulary; the training segment length (data.seq_len)
CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "memory"
#: Each memory of configs/memory at a tiny size (lengths shorter than a few segments, so they fill and evict).
TINY = {
    "xl": {"mem_len": 5},
    "compressive": {"mem_len": 4, "compressed_len": 3, "rate": 2},
    "memorizing": {"store_size": 9, "topk": 3, "mem_len": 2},
    "spalm": {"mem_len": 5, "k": 2, "store": "toy"},
}


class ToyStore:
    """SPALM's long-term store, in memory: a query is the running mean of fixed random token vectors (it
    depends only on the prefix, as a causal LM's encoding does), entries are random keys with random
    next tokens, searched exactly."""

    def __init__(self, dim: int = 8, entries: int = 40, seed: int = 5):
        g = torch.Generator().manual_seed(seed)
        self.table, self.keys = torch.randn(V, dim, generator=g), torch.randn(entries, dim, generator=g)
        self.values = torch.randint(0, V, (entries,), generator=g)
        self.encoder, self.path, self.vocab_size = nn.Identity(), Path("toy"), V

    def encode(self, tokens: Tensor, key_padding: Tensor | None, segments: Tensor | None) -> Tensor:
        e = self.table[tokens]  # [B, S, D]
        steps = torch.arange(1, tokens.shape[1] + 1, dtype=e.dtype)[:, None]  # [S, 1]
        return (e.cumsum(1) / steps).flatten(0, 1)  # [B * S, D]

    def search(self, queries: Tensor, k: int) -> SimpleNamespace:
        dists, idx = torch.cdist(queries, self.keys).pow(2).topk(k, largest=False)  # [N, k] ascending
        return SimpleNamespace(dists=dists, values=self.values[idx])


def memory_model(kind: str, pos: str = "xl") -> XfamModel:
    """A tiny seeded model (eval mode) with ``configs/memory/<kind>.yaml`` at the sizes of TINY."""
    cfg = {**yaml.safe_load((CONFIGS / f"{kind}.yaml").read_text()), **TINY[kind]}
    if kind != "spalm":
        return build_model(pos=pos, vocab_size=V, memory=cfg)
    torch.manual_seed(0)
    spec = ModelSpec(dim=32, layers=2, heads=4, max_len=32)
    model = XfamModel(
        spec,
        task="lm",
        vocab_size=V,
        attention={"name": "vanilla"},
        pos={"name": pos},
        memory=cfg,
        exit={"name": "none"},
        stores={spec.layers - 1: ToyStore()},
    )
    return model.eval()


def rerun_greedy(model: XfamModel, prompt: Tensor, n: int, boundary: int | None = None) -> tuple[Tensor, Tensor]:
    """The definition, by brute force: before every new token, the model runs over the whole stream from
    empty memory, one training segment at a time, each with the memory the segment before it wrote
    (documents, when marked, numbered as the data collator does); the next token is the argmax of the
    last position's logits."""
    tokens, used = prompt, []
    for _ in range(n):
        memory, logits = model.init_memory(tokens.shape[0], tokens.device), None
        for a in range(0, tokens.shape[1], SEG):
            seg = tokens[:, a : a + SEG]
            docs = None
            if boundary is not None:  # document k starts after the k-th boundary token of the stream
                ends = (tokens[:, : a + seg.shape[1]] == boundary).long()
                docs = (ends.cumsum(1) - ends)[:, a:]
            out = model(seg, segments=docs, memory=memory)
            memory, logits = out.memory, out.logits[:, -1]
        used.append(logits)
        tokens = torch.cat((tokens, logits.argmax(-1, keepdim=True)), dim=1)
    return tokens, torch.stack(used, dim=1)


@pytest.mark.parametrize("prompt_len", [3, SEG, 2 * SEG + 2], ids=["short", "one_segment", "long"])
@pytest.mark.parametrize("boundary", [None, 2], ids=["stream", "documents"])
def test_xl_greedy_generation_equals_rerunning_the_stream_each_step(prompt_len: int, boundary: int | None) -> None:
    model = memory_model("xl")
    prompt = torch.randint(0, V, (2, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    if boundary is not None:
        prompt[0, 1] = prompt[1, prompt_len - 1] = boundary  # documents end inside the prompt
    got = generate(model, prompt, 3 * SEG + 1, temperature=0, segment_len=SEG, boundary=boundary)
    want_tokens, want_logits = rerun_greedy(model, prompt, 3 * SEG + 1, boundary)
    assert torch.equal(got.tokens, want_tokens)
    assert torch.allclose(got.logits, want_logits, atol=1e-5)


def test_the_memory_matters_to_the_test_above() -> None:
    """A mutation the brute-force comparison would catch: each segment starting from empty memory."""
    model = memory_model("xl")
    tokens = torch.randint(0, V, (2, 3 * SEG), generator=torch.Generator().manual_seed(1))
    carried = stream_logits(model, tokens, SEG)
    fresh = torch.cat([model(tokens[:, a : a + SEG]).logits for a in range(0, 3 * SEG, SEG)], dim=1)
    assert torch.allclose(carried[:, :SEG], fresh[:, :SEG], atol=1e-6)  # the first segment has no memory
    assert not torch.allclose(carried[:, SEG:], fresh[:, SEG:], atol=1e-3)


@pytest.mark.parametrize("kind", sorted(p.stem for p in CONFIGS.glob("*.yaml") if p.stem != "none"))
def test_every_memory_generates_as_the_stream_defines(kind: str) -> None:
    """Sampling across several segment boundaries; each token's logits equal those of the stream run
    segment by segment (memory filled, evicted, compressed, stored, retrieved along the way)."""
    assert kind in TINY, f"configs/memory/{kind}.yaml is new: add its tiny sizes to TINY"
    model = memory_model(kind)
    prompt = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(3))
    g = generate(model, prompt, 4 * SEG, temperature=1.0, generator=torch.Generator().manual_seed(0), segment_len=SEG)
    assert g.tokens.shape == (2, 5 + 4 * SEG) and torch.equal(g.tokens[:, :5], prompt)
    want = stream_logits(model, g.tokens[:, :-1], SEG)[:, 4:]  # the logits each new token was drawn from
    assert torch.allclose(g.logits, want, atol=1e-5)


def test_generation_stops_at_the_stop_token_with_memory() -> None:
    model = memory_model("xl")
    prompt = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(4))
    full = generate(model, prompt, 8, temperature=0, segment_len=SEG).tokens
    stop = int(full[0, 8])
    assert generate(model, prompt, 8, temperature=0, segment_len=SEG, stop_token=stop).tokens.shape[1] <= 9


def test_a_memory_model_without_its_segment_length_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"segment by segment.*Fix: pass segment_len=<the checkpoint's data.seq_len>"):
        generate(memory_model("xl"), torch.zeros(1, 3, dtype=torch.long), 2)


def test_what_cannot_generate_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"causal language model; this checkpoint is a model of task 'classify'"):
        generate(build_model(task="classify"), torch.zeros(1, 3, dtype=torch.long), 2)
    model = build_model(vocab_size=V)
    monkeypatch.setattr(type(model.blocks[0].attn.mechanism), "fixed_length", True)
    with pytest.raises(ConfigError, match=r"attention=vanilla needs every sequence to have exactly model.max_len"):
        generate(model, torch.zeros(1, 3, dtype=torch.long), 2)


@pytest.mark.parametrize(
    "attention, pos",
    [("vanilla", "rope"), ("vanilla", "alibi"), ("local", "rope"), ("performer", "none")],
    ids=["rope", "alibi", "local", "performer"],
)
@pytest.mark.parametrize("kind", ["xl", "compressive"])
def test_memory_read_into_a_decode_cache_runs_one_token_per_call(kind: str, attention: str, pos: str) -> None:
    """Inside a segment a memory read as states in front of the keys decodes with a cache (``CachedSegments``):
    one row per call after the segment's first, and the logits of the stream run segment by segment."""
    cfg = {**yaml.safe_load((CONFIGS / f"{kind}.yaml").read_text()), **TINY[kind]}
    attn = {"name": attention, **({"window": 3} if attention == "local" else {})}
    model = build_model(attention=attn, pos=pos, vocab_size=V, memory=cfg, max_len=32)
    rows: list[int] = []
    hook = model.register_forward_pre_hook(lambda _m, args: rows.append(args[0].shape[1]))
    prompt = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(7))
    g = generate(model, prompt, 4 * SEG, temperature=0, segment_len=SEG)
    hook.remove()
    want = stream_logits(model, g.tokens[:, :-1], SEG)[:, 5:]
    assert torch.allclose(g.logits, want, atol=1e-5)
    run = 6 + 4 * SEG - 1  # tokens the model ran (not the last one drawn)
    # calls of more than one row: the prompt's, and each completed segment's one rerun that writes the memory
    assert sum(r > 1 for r in rows) <= 1 + (run - 1) // SEG and sum(rows) <= run + SEG * ((run - 1) // SEG)
