"""Inputs beyond tokens (``xfam.model.inputs``): the vector embedding, the ViT's patch embedding and class
token, the causal regress model, its metrics and its generation (cached equals recomputed)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from xfam.core.errors import ConfigError
from xfam.eval.continuous import generate_continuous
from xfam.eval.metrics import batch_stats, summarize
from xfam.model.build import model_io
from xfam.model.inputs import TOKENS, PatchEmbedding, VectorEmbedding, inputs_of, patchify
from xfam.model.spec import ModelSpec
from xfam.model.transformer import XfamModel

NONE = {"name": "none"}
IMAGE = {"kind": "image", "channels": 2, "height": 8, "width": 12}


def tiny(task: str, inputs: dict, pos: str = "rope", **spec) -> XfamModel:
    torch.manual_seed(0)
    spec = ModelSpec(**{"dim": 32, "layers": 2, "heads": 4, "max_len": 64, **spec})
    model = XfamModel(
        spec,
        task=task,
        vocab_size=0,
        num_classes=5 if task == "classify" else None,
        attention={"name": "vanilla"},
        pos={"name": pos},
        memory=NONE,
        exit=NONE,
        inputs=inputs,
        target_dim=inputs.get("dim"),
    )
    return model.eval()


def test_vector_embedding_is_one_linear_map_at_every_position() -> None:
    emb = VectorEmbedding(3, 8)
    x = torch.randn(2, 5, 3)
    assert torch.allclose(emb(x), x @ emb.proj.weight.T + emb.proj.bias, atol=1e-6)
    with pytest.raises(ValueError, match="vectors of 3 values"):
        emb(torch.randn(2, 5, 4))


def test_patches_are_raster_order_and_the_projection_is_a_stride_p_convolution() -> None:
    images = torch.randn(2, 2, 8, 12)
    x = patchify(images, 4)  # [B, 6, 2 * 16]
    assert x.shape == (2, 6, 32)
    # patch n is the block at row n // 3, column n % 3 (raster order), flattened channel-major
    assert torch.equal(x[1, 4], images[1, :, 4:8, 4:8].reshape(-1))
    emb = PatchEmbedding(2, 4, 16, cls_token=False)
    w, b = emb.vectors.proj.weight, emb.vectors.proj.bias
    conv = F.conv2d(images, w.view(16, 2, 4, 4), b, stride=4)  # [B, D, 2, 3]: the paper's "hybrid" view
    assert torch.allclose(emb(images), conv.flatten(2).transpose(1, 2), atol=1e-5)


def test_the_class_token_is_the_first_row_and_mean_pooling_has_none() -> None:
    cls = PatchEmbedding(2, 4, 16, cls_token=True)
    with torch.no_grad():
        cls.cls.normal_()
    rows = cls(torch.randn(3, 2, 8, 12))
    assert rows.shape == (3, 7, 16) and torch.equal(rows[:, 0], cls.cls[0].expand(3, -1))
    assert PatchEmbedding(2, 4, 16, cls_token=False)(torch.randn(3, 2, 8, 12)).shape == (3, 6, 16)


def test_a_vit_without_positions_is_invariant_to_permuting_patches() -> None:
    """ViT (sec. 3.1): the patches are a set unless position embeddings order them; a mean-pooled ViT without
    positions gives the same logits for an image whose patches are permuted, and with positions it does not."""
    images = torch.randn(2, 2, 8, 12)
    blocks = images.unfold(2, 4, 4).unfold(3, 4, 4)  # [B, C, 2, 3, 4, 4]
    swapped = blocks[:, :, [1, 0]][:, :, :, [2, 0, 1]]  # rows and columns of patches permuted
    permuted = swapped.permute(0, 1, 2, 4, 3, 5).reshape(2, 2, 8, 12)
    plain = tiny("classify", IMAGE, pos="none", pool="mean")
    assert torch.allclose(plain(images).logits, plain(permuted).logits, atol=1e-5)
    placed = tiny("classify", IMAGE, pos="learned", pool="mean")
    assert not torch.allclose(placed(images).logits, placed(permuted).logits, atol=1e-4)


def test_a_vit_classifies_from_the_class_token_and_trains() -> None:
    model = tiny("classify", IMAGE, pos="learned", pool="cls").train()
    images = torch.randn(4, 2, 8, 12)
    logits = model(images).logits
    assert logits.shape == (4, 5)
    F.cross_entropy(logits, torch.tensor([0, 1, 2, 3])).backward()
    assert model.embed.cls.grad is not None and model.embed.cls.grad.abs().sum() > 0
    assert model.embed.vectors.proj.weight.grad.abs().sum() > 0


def test_the_regress_model_is_causal_and_predicts_vectors() -> None:
    model = tiny("regress", {"kind": "vectors", "dim": 3})
    assert model.causal and model.head.out_features == 3 and model.head.bias is not None
    x = torch.randn(2, 10, 3)
    y = x.clone()
    y[:, 6:] += 1.0  # a change from step 6 on reaches no earlier prediction
    a, b = model(x).logits, model(y).logits
    assert a.shape == (2, 10, 3)
    assert torch.allclose(a[:, :6], b[:, :6], atol=1e-6) and not torch.allclose(a[:, 6:], b[:, 6:])


def test_regress_metrics_are_mse_rmse_and_mae_over_every_value() -> None:
    pred = torch.tensor([[[1.0, 2.0], [0.0, 0.0]]])  # [1, 2, 2]
    batch = {"targets": torch.tensor([[[0.0, 0.0], [0.0, 3.0]]])}
    stats = batch_stats("regress", pred, batch, None)
    out = summarize(stats, "regress", "val")
    close = lambda a, b: math.isclose(float(a), b, rel_tol=1e-6)  # noqa: E731  (float32 sums)
    assert close(out["val/mse"], (1 + 4 + 0 + 9) / 4) and torch.equal(out["val/loss"], out["val/mse"])
    assert close(out["val/rmse"], math.sqrt(14 / 4)) and close(out["val/mae"], 6 / 4)
    assert "val/acc" not in out


@pytest.mark.parametrize("pos", ["learned", "rope", "alibi"])
def test_cached_continuous_generation_equals_recomputation(pos: str) -> None:
    model = tiny("regress", {"kind": "vectors", "dim": 3}, pos=pos)
    prefix = torch.randn(2, 5, 3)
    cached = generate_continuous(model, prefix, 6)
    full = generate_continuous(model, prefix, 6, cache=False)
    assert cached.shape == (2, 6, 3)
    assert torch.allclose(cached, full, atol=1e-5)
    # each new vector is the prediction from everything before it, fed back as the next input
    seq = torch.cat((prefix, cached), dim=1)
    assert torch.allclose(model(seq[:, :-1]).logits[:, 4:], cached, atol=1e-5)


def test_continuous_generation_refuses_other_models_and_empty_prefixes() -> None:
    with pytest.raises(ConfigError, match="causal regress model"):
        generate_continuous(tiny("classify", IMAGE), torch.randn(1, 2, 3), 2)
    with pytest.raises(ConfigError, match="prefix"):
        generate_continuous(tiny("regress", {"kind": "vectors", "dim": 3}), torch.randn(1, 0, 3), 2)


def test_data_without_inputs_means_tokens() -> None:
    """A checkpoint written before inputs were recorded: token ids, and the same model shape as today's."""
    old = {"task": "lm", "vocab_size": 7, "num_classes": None}
    assert inputs_of(old) == TOKENS
    assert model_io({"model": {}}, old) == model_io({"model": {}}, {**old, "inputs": TOKENS, "target_dim": None})
