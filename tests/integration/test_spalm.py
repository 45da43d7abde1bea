"""SPALM (memory=spalm): the long-term memory's mix follows the paper's equations, an open gate is
exactly Transformer-XL, a token never retrieves its own entry, the store and its encoder get no
gradient, bad settings are refused before work starts, and a run trains and evaluates end to end."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.integration.helpers import TINY, compose_cfg, text_data
from xfam.config import validate
from xfam.core.errors import ConfigError
from xfam.eval.knnlm import build_datastore
from xfam.eval.loop import evaluate, split_loader
from xfam.model.build import build_model
from xfam.model.checkpoint import load_model
from xfam.training.runner import train

SPALM = ["memory=spalm", "pos=xl", "memory.mem_len=32"]


@pytest.fixture(scope="module")
def base(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A pretrained model (memory=none) and a datastore of 10 batches of its train split."""
    run_dir = tmp_path_factory.mktemp("spalm-base")
    train(compose_cfg([*TINY, *text_data(corpus)]), run_dir)
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    return corpus, ckpt, build_datastore(ckpt, "train", run_dir / "store", limit=10)


def spalm_cfg(corpus: Path, store: Path, *extra: str) -> dict:
    return compose_cfg([*TINY, *text_data(corpus), *SPALM, f"memory.store={store}", *extra])


def built(cfg: dict, store: Path) -> torch.nn.Module:
    _, meta = load_model(Path(store).parent / "checkpoints" / "last.ckpt")
    return build_model(cfg, meta["data_info"])


def test_the_mix_follows_the_papers_equations(base: tuple[Path, Path, Path]) -> None:
    corpus, _, store = base
    spalm = built(spalm_cfg(corpus, store), store).memories[-1]
    torch.manual_seed(0)
    h, emb = torch.randn(2, 3, 32), torch.randn(50, 32)
    ids = torch.randint(0, 50, (2, 3, 4))
    ok = torch.ones(2, 3, 4, dtype=torch.bool)
    ok[0, 1, 2:] = False  # two neighbours dropped for one position
    ok[1, 2] = False  # nothing usable: m_t = 0
    z = spalm.mix(h, (ids, ok), emb)
    for b, t in [(0, 0), (0, 1), (1, 0), (1, 2)]:
        y = emb[ids[b, t][ok[b, t]]]  # [k', D]
        m = torch.softmax(y @ h[b, t], 0) @ y if len(y) else torch.zeros(32)
        g = torch.sigmoid(spalm.gate.weight[0] @ h[b, t] + spalm.gate.bias[0])
        assert torch.allclose(z[b, t], (1 - g) * m + g * h[b, t], atol=1e-5)


def test_an_open_gate_is_exactly_transformer_xl(base: tuple[Path, Path, Path]) -> None:
    corpus, _, store = base
    torch.manual_seed(0)
    model = built(spalm_cfg(corpus, store), store)
    xl = built(compose_cfg([*TINY, *text_data(corpus), "memory=xl", "pos=xl", "memory.mem_len=32"]), store)
    xl.load_state_dict({k: v for k, v in model.state_dict().items() if ".gate." not in k})
    with torch.no_grad():
        model.memories[-1].gate.bias.fill_(math.inf)  # g_t = 1: z_t = h_t
    tokens = torch.randint(0, 50, (2, 16))
    mem_a, mem_b = model.init_memory(2, "cpu"), xl.init_memory(2, "cpu")
    for seg in (tokens[:, :8], tokens[:, 8:]):  # two segments: the short-term memory is XL's
        a, b = model(seg, memory=mem_a), xl(seg, memory=mem_b)
        assert torch.equal(a.logits, b.logits)
        mem_a, mem_b = a.memory, b.memory
    with torch.no_grad():
        model.memories[-1].gate.bias.fill_(0.0)
    assert not torch.equal(model(tokens[:, :8]).logits, xl(tokens[:, :8]).logits)  # a closed gate matters


def test_a_token_never_retrieves_its_own_entry(base: tuple[Path, Path, Path]) -> None:
    corpus, ckpt, store = base
    _, meta = load_model(ckpt)
    batch = next(iter(split_loader(meta["config"], meta["data_info"], "train", None)[0]))  # the store's first rows
    keep = batch["labels"] != -100
    share = {}
    for exclude in (False, True):
        spalm = built(spalm_cfg(corpus, store, f"memory.exclude_identical={str(exclude).lower()}"), store).memories[-1]
        ids, ok = spalm.retrieve(batch["input_ids"], None, batch.get("segments"))
        assert ok.all() or exclude
        share[exclude] = (ids[..., 0] == batch["labels"])[keep].float().mean().item()
    print(share)
    # Without exclusion the nearest entry is the position's own (or an identical context's): its answer.
    assert share[False] > 0.95
    assert share[True] < share[False] - 0.3


def test_gradients_reach_the_gate_and_the_word_embeddings_only(base: tuple[Path, Path, Path]) -> None:
    corpus, _, store = base
    model = built(spalm_cfg(corpus, store, "model.tie_embeddings=true"), store)
    spalm = model.memories[-1]
    out = model(torch.randint(0, 50, (2, 8)), memory=model.init_memory(2, "cpu"))
    out.logits.logsumexp(-1).sum().backward()
    assert spalm.gate.weight.grad.abs().sum() > 0 and model.embed.weight.grad.abs().sum() > 0
    encoder = spalm._store.encoder
    assert all(not p.requires_grad and p.grad is None for p in encoder.parameters())
    assert not any("encoder" in k or "_store" in k for k in model.state_dict())  # frozen, never saved


def test_bad_settings_are_refused_before_work_starts(base: tuple[Path, Path, Path], tmp_path: Path) -> None:
    corpus, _, store = base
    first_layer = f"+memory.per_layer={{0: {{name: spalm, store: {store}}}}}"
    cases = {
        "needs memory.store=DIR": spalm_cfg(corpus, store, "memory.store=null"),
        "is not a datastore": spalm_cfg(corpus, tmp_path / "missing"),
        "put it at the last layer": compose_cfg([*TINY, *text_data(corpus), "memory=xl", "pos=xl", first_layer]),
        "exit=none": spalm_cfg(corpus, store, "exit=calm"),
    }
    for message, cfg in cases.items():
        with pytest.raises(ConfigError, match=message):
            validate(cfg)


def test_a_run_trains_and_xfam_eval_reports_its_metrics(base: tuple[Path, Path, Path], tmp_path: Path) -> None:
    corpus, _, store = base
    metrics = train(spalm_cfg(corpus, store), tmp_path / "run")
    got = evaluate(str(tmp_path / "run" / "checkpoints" / "last.ckpt"), "test", None, 2, "cpu")
    assert got["test/loss"] == pytest.approx(float(metrics["test/loss"]), rel=1e-5)
