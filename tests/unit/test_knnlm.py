"""kNN-LM (Khandelwal et al., 2020): the kNN distribution against a hand computation, the interpolation's
limits (λ = 0 is the model exactly, λ = 1 is p_kNN), self-exclusion, exact search against brute force
and FAISS, the key the hook captures, and the refusals (another model's store, unsupported models)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from doubles import build_model

import xfam.knnlm.search as search
from xfam.core.errors import ConfigError
from xfam.eval.knnlm import KnnScorer
from xfam.knnlm import (
    Datastore,
    DatastoreWriter,
    KeyCapture,
    check_supported,
    checkpoint_identity,
    interpolate,
    interpolated_log_probs,
    knn_log_probs,
    knn_target_log_probs,
)
from xfam.knnlm.search import ExactIndex, FaissIndex

IDENTITY = {"path": "/ckpt/a.ckpt", "step": 6, "weights_sha256": "a" * 64}


def make_store(path: Path, keys: torch.Tensor, values: torch.Tensor, index: str = "exact", **kw) -> Datastore:
    writer = DatastoreWriter(path, keys.shape[1], "float32", **kw)
    writer.add(keys[: len(keys) // 2], values[: len(keys) // 2])  # two batches: appending must keep the order
    writer.add(keys[len(keys) // 2 :], values[len(keys) // 2 :])
    writer.finish(checkpoint=IDENTITY, split="train")
    return Datastore.open(path, index=index)


@pytest.fixture
def tiny_store(tmp_path: Path) -> Datastore:
    keys = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [3.0, 3.0]])  # squared distances to 0: 0, 1, 4, 18
    return make_store(tmp_path / "tiny", keys, torch.tensor([1, 2, 1, 0]))


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_knn_distribution_matches_a_hand_computation(tiny_store: Datastore, temperature: float) -> None:
    nb = tiny_store.search(torch.tensor([[0.0, 0.0]]), k=3)
    assert nb.rows.tolist() == [[0, 1, 2]] and nb.values.tolist() == [[1, 2, 1]]
    assert torch.allclose(nb.dists, torch.tensor([[0.0, 1.0, 4.0]]))  # squared L2
    w = [math.exp(-d / temperature) for d in (0.0, 1.0, 4.0)]
    z = sum(w)
    expected = torch.tensor([0.0, (w[0] + w[2]) / z, w[1] / z, 0.0])  # token 3: never a value; 0: not among 3
    got = knn_log_probs(nb.dists, nb.values, 4, temperature)[0]
    assert torch.allclose(got.exp(), expected, atol=1e-7)
    assert torch.isneginf(got[0]) and torch.isneginf(got[3])
    targets = torch.tensor([1])
    assert torch.allclose(knn_target_log_probs(nb.dists, nb.values, targets, temperature), got[1:2])
    assert torch.isneginf(knn_target_log_probs(nb.dists, nb.values, torch.tensor([3]), temperature)).all()


def test_far_neighbours_do_not_underflow_to_zero_probability() -> None:
    dists = torch.tensor([[0.0, 500.0]])  # exp(-500) underflows fp32; its log-probability must not
    values = torch.tensor([[0, 1]])
    got = knn_log_probs(dists, values, 2)[0]
    assert torch.isfinite(got[1]) and abs(float(got[1]) + 500.0) < 1e-3
    assert abs(float(knn_target_log_probs(dists, values, torch.tensor([1]))[0]) + 500.0) < 1e-3


def test_lambda_zero_is_the_model_exactly_and_one_is_knn_exactly(tiny_store: Datastore) -> None:
    logits = torch.randn(5, 4) * 3
    keys = torch.randn(5, 2)
    lm = F.log_softmax(logits, dim=-1)
    got0 = interpolated_log_probs(logits, keys, tiny_store, k=3, lam=0.0)
    assert torch.equal(got0, lm)
    nb = tiny_store.search(keys, 3)
    knn = knn_log_probs(nb.dists, nb.values, 4)
    assert torch.equal(interpolated_log_probs(logits, keys, tiny_store, k=3, lam=1.0), knn)
    assert torch.isneginf(knn).any()  # the limits hold with tokens that no neighbour carries
    lam = 0.25
    mixed = interpolated_log_probs(logits, keys, tiny_store, k=3, lam=lam)
    assert torch.allclose(mixed.exp(), lam * knn.exp() + (1 - lam) * lm.exp(), atol=1e-6)
    assert torch.allclose(mixed.exp().sum(-1), torch.ones(5), atol=1e-5)
    assert torch.equal(interpolate(lm[:, 0], knn[:, 0], 0.0), lm[:, 0])


def test_interpolation_options_are_checked(tiny_store: Datastore) -> None:
    with pytest.raises(ConfigError, match="lambda=1.5"):
        interpolate(torch.zeros(2), torch.zeros(2), 1.5)
    with pytest.raises(ConfigError, match="3 configuration problems"):
        interpolated_log_probs(torch.zeros(1, 4), torch.zeros(1, 2), tiny_store, k=0, lam=-1, temperature=0)
    with pytest.raises(ConfigError, match="k=5 neighbours asked of a datastore of 4 entries"):
        tiny_store.search(torch.zeros(1, 2), k=5)
    with pytest.raises(ConfigError, match="k=3 or less"):
        tiny_store.search(torch.zeros(1, 2), k=4, self_rows=torch.tensor([0]))


def brute_force(queries: torch.Tensor, keys: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    d = torch.cdist(queries.double(), keys.double()) ** 2  # [N, M]
    dists, rows = torch.topk(d, k, dim=1, largest=False)
    return dists.float(), rows


@pytest.mark.parametrize("in_memory", [True, False])
def test_chunked_exact_search_equals_brute_force(in_memory: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not in_memory:  # the memmap path: keys read chunk by chunk
        monkeypatch.setattr(search, "IN_MEMORY_BYTES", 0)
    keys = torch.randn(1000, 8)
    queries = torch.randn(1100, 8)  # > 1024: the queries are chunked too
    index = ExactIndex(keys.numpy(), budget=2048)  # tiny budget: the store is scanned in many chunks
    assert in_memory == isinstance(index.keys, torch.Tensor)
    dists, rows = index.search(queries, 16)
    ref_d, ref_rows = brute_force(queries, keys, 16)
    assert torch.equal(rows, ref_rows)
    assert torch.allclose(dists, ref_d, rtol=1e-4, atol=1e-4)
    assert (dists[:, 1:] >= dists[:, :-1]).all()  # ascending: a prefix is the top-k'


def test_faiss_search_equals_exact_search(tmp_path: Path) -> None:
    pytest.importorskip("faiss")
    keys, values = torch.randn(500, 16), torch.randint(0, 50, (500,))
    exact = make_store(tmp_path / "a", keys, values, index="exact")
    flat = Datastore.open(tmp_path / "a", index="faiss")
    assert isinstance(flat.index, FaissIndex)
    queries = torch.randn(64, 16)
    a, b = exact.search(queries, 20), flat.search(queries, 20)
    assert torch.equal(a.rows, b.rows) and torch.equal(a.values, b.values)
    assert torch.allclose(a.dists, b.dists, rtol=1e-4, atol=1e-4)
    self_rows = torch.arange(64)
    a, b = exact.search(keys[:64], 20, self_rows), flat.search(keys[:64], 20, self_rows)
    assert torch.equal(a.rows, b.rows)


def test_missing_faiss_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_faiss(name: str, *args, **kwargs):
        if name == "faiss":
            raise ImportError("no faiss")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_faiss)
    with pytest.raises(ConfigError, match=r"pip install 'xfam\[faiss\]'.*index=exact"):
        FaissIndex(np.zeros((2, 2), dtype=np.float32))


def test_a_query_never_retrieves_its_own_entry(tmp_path: Path) -> None:
    keys = torch.randn(200, 4)
    keys[1] = keys[0]  # an exact duplicate: a different occurrence at distance 0 stays retrievable
    store = make_store(tmp_path / "s", keys, torch.randint(0, 9, (200,)))
    own = torch.arange(200)
    nb = store.search(keys, 5, self_rows=own)
    assert not (nb.rows == own.unsqueeze(1)).any()
    assert nb.rows[0, 0] == 1 and nb.rows[1, 0] == 0 and float(nb.dists[0, 0]) < 1e-5
    for i in (5, 77, 199):  # = brute force over the store without row i
        others = torch.cat((torch.arange(i), torch.arange(i + 1, 200)))
        ref_d, ref_rows = brute_force(keys[i : i + 1], keys[others], 5)
        assert torch.equal(nb.rows[i], others[ref_rows[0]])
    plain = store.search(keys, 5)
    assert torch.equal(plain.rows[2:, 0], torch.arange(2, 200))  # without exclusion: itself first
    partial = store.search(keys[:3], 5, self_rows=torch.tensor([0, 1, -1]))  # -1: not in the store
    assert torch.equal(partial.rows[2], plain.rows[2])


def test_scorer_on_the_store_split_excludes_self_matches(tmp_path: Path) -> None:
    # Four keys in two far clusters; each key's other cluster member carries another value, so with its
    # own entry excluded λ = 1, k = 1 never predicts the target, and without exclusion always does.
    keys = torch.tensor([[0.0, 0.0], [0.1, 0.0], [9.0, 9.0], [9.0, 9.1]])
    values = torch.tensor([1, 2, 3, 0])
    store = make_store(tmp_path / "s", keys, values)
    batch = {"labels": values.view(1, 4)}
    logits = torch.zeros(1, 4, 4)  # uniform model: log p = -log 4
    for exclude, coverage in ((True, 0.0), (False, 1.0)):
        scorer = KnnScorer(store, [1, 2], [0.0, 0.5, 1.0], exclude_self=exclude)
        scorer.add(batch, logits, keys.view(1, 4, 2))
        m = scorer.metrics("test")
        assert m[(1, 1.0)]["test/coverage"] == coverage
        assert m[(1, 0.0)]["test/loss"] == m["base"]["test/loss"] == pytest.approx(math.log(4))
        if exclude:
            assert m[(1, 1.0)]["test/loss"] == math.inf
            assert m[(1, 0.5)]["test/loss"] == pytest.approx(-math.log(0.5 * 0.25))
        else:
            assert m[(1, 1.0)]["test/loss"] == 0.0 and m[(1, 1.0)]["test/acc"] == 1.0
    with pytest.raises(ConfigError, match="not in the order of the datastore"):
        KnnScorer(store, [1], [0.5], exclude_self=True).add(
            {"labels": torch.tensor([[2, 1, 3, 0]])}, logits, keys[None]
        )


def test_store_of_another_model_is_refused(tmp_path: Path) -> None:
    config = {"model": {"dim": 32}, "attention": {"name": "vanilla"}}
    a, b = build_model(seed=0), build_model(seed=1)
    ident_a = checkpoint_identity(tmp_path / "a.ckpt", a, config)
    assert ident_a == checkpoint_identity(tmp_path / "a.ckpt", build_model(seed=0), config)  # stable
    assert ident_a["weights_sha256"] != checkpoint_identity(tmp_path / "a.ckpt", b, config)["weights_sha256"]
    other_arch = {**config, "attention": {"name": "local"}}
    assert ident_a["weights_sha256"] != checkpoint_identity(tmp_path / "a.ckpt", a, other_arch)["weights_sha256"]
    writer = DatastoreWriter(tmp_path / "s", 2)
    writer.add(torch.zeros(3, 2), torch.zeros(3, dtype=torch.long))
    writer.finish(checkpoint=ident_a, split="train")
    store = Datastore.open(tmp_path / "s")
    store.check_checkpoint(ident_a)
    ident_b = checkpoint_identity(tmp_path / "b.ckpt", b, config)
    with pytest.raises(ConfigError, match=r"built from another model.*Fix: build one for this checkpoint"):
        store.check_checkpoint(ident_b)
    with pytest.raises(ConfigError, match=r"built from another model"):
        Datastore.open(tmp_path / "s", checkpoint=ident_b)  # refused before the keys are read
    Datastore.open(tmp_path / "s", checkpoint=ident_a)


def test_unfinished_or_existing_stores_are_refused(tmp_path: Path) -> None:
    writer = DatastoreWriter(tmp_path / "s", 2)
    writer.add(torch.zeros(1, 2), torch.zeros(1, dtype=torch.long))
    with pytest.raises(ConfigError, match="unfinished build"):
        Datastore.open(tmp_path / "s")
    writer.finish(checkpoint=IDENTITY, split="train")
    with pytest.raises(ConfigError, match="overwrite=true"):
        DatastoreWriter(tmp_path / "s", 2)
    DatastoreWriter(tmp_path / "s", 2, overwrite=True)
    with pytest.raises(ConfigError, match="not a datastore"):
        Datastore.open(tmp_path / "nothing")


@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_the_key_is_the_final_ffn_input_after_its_norm(norm_position: str) -> None:
    model = build_model(norm_position=norm_position, layers=3)
    seen = []
    last = model.blocks[-1]
    normed = last.norm2 if norm_position == "pre" else last.norm1  # post-norm: the FFN reads norm1's output
    handle = normed.register_forward_hook(lambda m, a, o: seen.append(o))
    tokens = torch.randint(0, 13, (2, 7))
    with KeyCapture(model) as capture:
        logits = model(tokens).logits
        keys = capture.take()
    handle.remove()
    assert keys.shape == (2, 7, 32)
    assert torch.equal(keys, seen[-1])
    assert torch.equal(logits, model(tokens).logits)  # the hook changes nothing
    assert not model.blocks[-1].ffn._forward_pre_hooks  # removed on exit


def test_keys_of_a_chunked_reversible_stack_and_with_global_tokens() -> None:
    tokens = torch.randint(0, 13, (2, 8))
    whole, chunked = build_model(reversible=True, seed=3), build_model(reversible=True, ffn_chunks=2, seed=3)
    with KeyCapture(whole) as a, KeyCapture(chunked) as b:
        whole(tokens), chunked(tokens)
        assert torch.allclose(a.take(), b.take(), atol=1e-6)  # the FFN's calls per chunk are joined in order
    etc = build_model(attention={"name": "etc", "global_tokens": 2, "radius": 4})
    seen = []
    handle = etc.blocks[-1].norm2.register_forward_hook(lambda m, a, o: seen.append(o))
    with KeyCapture(etc) as capture:
        etc(tokens)
        keys = capture.take()
    handle.remove()
    assert keys.shape == (2, 8, 32) and torch.equal(keys, seen[-1][:, 2:])  # ETC's global tokens dropped


def test_unsupported_models_are_refused() -> None:
    check_supported(build_model())
    with pytest.raises(ConfigError, match="exit=toy_stop.*Fix: use a model trained with exit=none"):
        check_supported(build_model(exit={"name": "toy_stop"}))
    with pytest.raises(ConfigError, match="classifier"):
        check_supported(build_model(task="classify"))
    check_supported(build_model(memory={"name": "toy_memory"}))  # memory is carried (test_eval_memory.py)


def test_generation_draws_from_the_interpolation_with_the_decode_cache_keys(tmp_path: Path) -> None:
    from xfam.eval.generate import generate
    from xfam.knnlm import KnnMixer

    model = build_model(pos="rope", vocab_size=13)
    keys, values = torch.randn(300, 32) * 3, torch.randint(0, 13, (300,))
    store = make_store(tmp_path / "s", keys, values)
    prompt = torch.randint(0, 13, (2, 4))
    plain = generate(model, prompt, 8, temperature=0)
    with_zero = generate(model, prompt, 8, temperature=0, knn=KnnMixer(model, store, k=5, lam=0.0))
    assert torch.equal(with_zero.tokens, plain.tokens)  # λ = 0: the model's own distribution
    assert torch.allclose(with_zero.logits, F.log_softmax(plain.logits, -1), atol=1e-6)
    # λ = 1, k = 1: each new token is the value of the entry nearest to the key of the position before it;
    # the keys the hook saw through the decode cache equal those of a full recompute.
    nearest = generate(model, prompt, 8, temperature=0, knn=KnnMixer(model, store, k=1, lam=1.0))
    with KeyCapture(model) as capture:
        model(nearest.tokens[:, :-1])
        full_keys = capture.take()[:, 3:]  # [B, 8, D]: positions whose next token was generated
    expected = store.search(full_keys.reshape(-1, 32), 1).values.view(2, 8)
    assert torch.equal(nearest.tokens[:, 4:], expected)
    assert not model.blocks[-1].ffn._forward_pre_hooks  # the hook is gone after generation
