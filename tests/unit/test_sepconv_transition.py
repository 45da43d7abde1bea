"""``model.ffn=sepconv``: the Universal Transformer's separable-convolution transition (Dehghani et al., 2019,
arXiv:1807.03819, sec. 2.1; the form of the authors' code, ``sepconv_relu_sepconv``): depthwise then pointwise,
twice, with a ReLU between; LEFT padding when causal, SAME when bidirectional; never across padding or documents;
decoding equal to recomputation; with ``exit=act`` as the UT's transition."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from doubles import build_model, decode_logits

from xfam.attention import ATTENTION
from xfam.core.mask import AttnMask
from xfam.exit import EXIT
from xfam.memory import MEMORY
from xfam.model import block_compat
from xfam.model.block import make_ffn
from xfam.model.compat import Selection
from xfam.model.sepconv import SepConvTransition
from xfam.model.spec import ModelSpec
from xfam.pos import POS

V, D = 13, 16


def transition(causal: bool, k1: int = 3, k2: int = 5, **spec) -> SepConvTransition:
    torch.manual_seed(0)
    s = ModelSpec(dim=D, ffn="sepconv", ffn_mult=2.0, sepconv_kernel1=k1, sepconv_kernel2=k2, **spec)
    return SepConvTransition(s, causal)


def conv_reference(t: SepConvTransition, x: torch.Tensor, causal: bool) -> torch.Tensor:
    """``sepconv_relu_sepconv`` with torch's grouped Conv1d: depthwise (groups = channels, LEFT or SAME zero
    padding), pointwise 1x1 with bias, ReLU, and again."""

    def sepconv(h: torch.Tensor, dw: torch.Tensor, pw: torch.nn.Linear) -> torch.Tensor:
        k = dw.shape[1]
        pad = (k - 1, 0) if causal else ((k - 1) // 2, (k - 1) // 2)
        h = F.conv1d(F.pad(h.transpose(1, 2), pad), dw[:, None, :], groups=dw.shape[0])  # [B, C, S]
        return F.conv1d(h, pw.weight[:, :, None], pw.bias).transpose(1, 2)  # pointwise: [B, S, C']

    return sepconv(F.relu(sepconv(x, t.dw1.weight, t.up)), t.dw2.weight, t.down)


@pytest.mark.parametrize("causal", [True, False])
def test_is_depthwise_then_pointwise_twice_with_a_relu(causal):
    t = transition(causal, bias=True)
    x = torch.randn(2, 9, D)
    out, _ = t(x)
    assert torch.allclose(out, conv_reference(t, x, causal), atol=1e-5)
    f = 2 * D  # hidden width F = ffn_mult * D
    # depthwise k per channel (no bias), then pointwise with bias: D*3 + (D*F + F) + F*5 + (F*D + D)
    assert sum(p.numel() for p in t.parameters()) == D * 3 + D * f + f + f * 5 + f * D + D


def test_causal_left_padding_never_reads_later_rows():
    t = transition(causal=True)
    x = torch.randn(1, 10, D)
    y = x.clone()
    y[:, 6] += 1.0
    a, b = t(x)[0], t(y)[0]
    assert torch.equal(a[:, :6], b[:, :6]) and not torch.allclose(a[:, 6:], b[:, 6:])
    # receptive field: row 6 reaches rows 6 .. 6 + (3 - 1) + (5 - 1) and no further
    z = torch.randn(1, 20, D)
    w = z.clone()
    w[:, 6] += 1.0
    changed = (t(z)[0] - t(w)[0]).abs().amax(-1)[0] > 0
    assert changed.nonzero().flatten().tolist() == list(range(6, 13))


def test_bidirectional_same_padding_is_centred():
    t = transition(causal=False)
    z = torch.randn(1, 20, D)
    w = z.clone()
    w[:, 10] += 1.0
    changed = (t(z)[0] - t(w)[0]).abs().amax(-1)[0] > 0
    assert changed.nonzero().flatten().tolist() == list(range(10 - 3, 10 + 4))  # +-1 then +-2: radius 3


@pytest.mark.parametrize("causal", [True, False])
def test_never_reads_padding_or_another_document(causal):
    t = transition(causal)
    x = torch.randn(1, 12, D)
    seg = torch.tensor([[0] * 5 + [1] * 7])
    out, _ = t(x, AttnMask(12, 12, causal, segments=seg))
    first, _ = t(x[:, :5])
    second, _ = t(x[:, 5:])
    assert torch.allclose(out, torch.cat((first, second), dim=1), atol=1e-6)  # each document as if alone
    pad = torch.tensor([[True] * 8 + [False] * 4])
    noisy = x.clone()
    noisy[:, 8:] = 1e3 * torch.randn(1, 4, D)
    out, _ = t(noisy, AttnMask(12, 12, causal, key_padding=pad))
    assert torch.allclose(out[:, :8], t(x[:, :8])[0], atol=1e-5)  # the real rows ignore the padding


def test_model_has_no_causal_leak_and_decodes_like_the_full_pass():
    model = build_model(ffn="sepconv", pos="rope", init_std=0.2)
    x = torch.randint(0, V, (2, 12))
    y = x.clone()
    y[:, 7] = (y[:, 7] + 1) % V
    a, b = model(x).logits, model(y).logits
    assert torch.equal(a[:, :7], b[:, :7]) and not torch.allclose(a[:, 7:], b[:, 7:], atol=1e-5)
    assert torch.allclose(decode_logits(model, x, prompt=1), a, atol=1e-5)  # prompt shorter than a kernel
    assert torch.allclose(decode_logits(model, x, prompt=5, step=3), a, atol=1e-5)
    pad = torch.ones(2, 12, dtype=torch.bool)
    pad[1, :3] = False  # a left-padded row
    full = model(x, key_padding=pad).logits
    assert torch.allclose(decode_logits(model, x, prompt=4, step=2, key_padding=pad)[1, 3:], full[1, 3:], atol=1e-5)


def test_universal_transformer_trains_with_act_and_decodes():
    """``exit=act model.ffn=sepconv``: the UT with its convolutional transition, one shared block applied up to
    T times; every step keeps its own decode rows, so cached decoding equals the full pass."""
    model = build_model(ffn="sepconv", exit={"name": "act", "halting_bias": 0.0}, layers=3, pos="rope").train()
    assert isinstance(model.blocks[0].ffn, SepConvTransition) and len(model.blocks) == 1
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randint(0, V, (4, 10))
    losses = []
    for _ in range(3):
        out = model(x)
        loss = F.cross_entropy(out.logits[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1)) + out.aux["exit/ponder"]
        opt.zero_grad()
        loss.backward()
        assert model.blocks[0].ffn.dw2.weight.grad.abs().sum() > 0
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    model.eval()
    with torch.no_grad():
        assert torch.allclose(decode_logits(model, x, prompt=2, step=3), model(x).logits, atol=1e-5)


def selection(memory: str = "none", reversible: bool = False) -> Selection:
    return Selection(
        attention=[(ATTENTION.get("vanilla"), {}, False)],
        pos=(POS.get("rope"), {}),
        memory=[(MEMORY.get(memory), {})],
        exit=(EXIT.get("act"), {}),
        causal=True,
        streams=True,
        reversible=reversible,
    )


def test_refusals_name_the_reason_and_the_fix():
    spec = ModelSpec(ffn="sepconv", sepconv_kernel2=4)
    (odd,) = block_compat.reasons(spec, selection())
    assert "sepconv_kernel2=4 must be odd" in odd and "Fix" in odd
    (mem,) = block_compat.reasons(ModelSpec(ffn="sepconv"), selection(memory="toy_memory"))
    assert "memory=none" in mem
    (rev,) = block_compat.reasons(ModelSpec(ffn="sepconv"), selection(reversible=True))
    assert "model.ffn=sepconv with model.reversible=true" in rev
    (stray,) = block_compat.reasons(ModelSpec(sepconv_kernel1=7), selection())
    assert "applies to model.ffn=sepconv" in stray
    assert not block_compat.reasons(ModelSpec(ffn="sepconv"), selection())
    assert not isinstance(make_ffn(ModelSpec(), causal=True), SepConvTransition)
