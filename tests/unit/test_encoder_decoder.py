"""The encoder-decoder: with weights copied across it equals PyTorch's ``nn.Transformer`` (post-norm) and
x-transformers' ``XTransformer`` (pre-norm) at the same shape; cached decoding equals recomputation for every
cross-attention mechanism; source padding is never seen."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import xfam.attention
import xfam.exit
import xfam.memory
import xfam.pos  # noqa: F401  (registers every component)
from xfam.attention import ATTENTION
from xfam.model.encoder_decoder import EncoderDecoder
from xfam.model.spec import ModelSpec
from xfam.model.transformer import XfamModel

NONE = {"name": "none"}
V = 23


def make(
    norm_position: str = "pre",
    *,
    dim: int = 32,
    heads: int = 4,
    head_dim: int | None = None,
    layers: int = 2,
    enc_layers: int = 2,
    bias: bool = False,
    attention: dict | None = None,
    cross: dict | None = None,
    pos: dict | None = None,
    tie: bool = False,
    max_len: int = 64,
) -> EncoderDecoder:
    common = dict(dim=dim, heads=heads, head_dim=head_dim, bias=bias, norm_position=norm_position, max_len=max_len)
    enc = XfamModel(
        ModelSpec(**common, layers=enc_layers, causal=False),
        task="encode",
        vocab_size=V,
        attention={"name": "vanilla"},
        pos=pos or NONE,
        memory=NONE,
        exit=NONE,
    )
    dec = XfamModel(
        ModelSpec(**common, layers=layers, tie_embeddings=tie),
        task="lm",
        vocab_size=V,
        attention=attention or {"name": "vanilla"},
        pos=pos or NONE,
        memory=NONE,
        exit=NONE,
        cross=cross or {"name": "vanilla"},
    )
    return EncoderDecoder(enc, dec, tie_embeddings=tie).eval()


def batch(b: int = 2, ss: int = 7, st: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    src, tgt = torch.randint(0, V, (b, ss), generator=g), torch.randint(0, V, (b, st), generator=g)
    pad = torch.ones(b, ss, dtype=torch.bool)
    pad[-1, ss - 2 :] = False  # the last row's source is 2 tokens shorter
    return src, tgt, pad


def _copy_mha(mha: nn.MultiheadAttention, q: nn.Linear, kv: nn.Linear | None, out: nn.Linear, fused: nn.Linear | None):
    """Copy torch MHA weights into xfam projections (``fused``: self-attention's one q/k/v Linear)."""
    w, b = mha.in_proj_weight.detach(), mha.in_proj_bias.detach()
    if fused is not None:
        fused.weight.copy_(w), fused.bias.copy_(b)
    else:
        d = q.weight.shape[0]
        q.weight.copy_(w[:d]), q.bias.copy_(b[:d]), kv.weight.copy_(w[d:]), kv.bias.copy_(b[d:])
    out.weight.copy_(mha.out_proj.weight), out.bias.copy_(mha.out_proj.bias)


@torch.no_grad()
def test_post_norm_equals_torch_nn_transformer():
    """Vaswani et al.'s post-norm encoder-decoder, as ``torch.nn.Transformer`` builds it (without the final norms
    that PyTorch adds for its pre-norm option), with biases and GELU."""
    torch.manual_seed(0)
    m = make("post", bias=True, layers=2, enc_layers=3)
    d, h, ffn = 32, 4, m.spec.ffn_hidden
    enc_layer = nn.TransformerEncoderLayer(d, h, ffn, dropout=0.0, activation="gelu", batch_first=True)
    dec_layer = nn.TransformerDecoderLayer(d, h, ffn, dropout=0.0, activation="gelu", batch_first=True)
    ref = nn.Transformer(
        d,
        h,
        custom_encoder=nn.TransformerEncoder(enc_layer, 3, enable_nested_tensor=False),
        custom_decoder=nn.TransformerDecoder(dec_layer, 2),
        batch_first=True,
    ).eval()
    for tl, xb in zip(ref.encoder.layers, m.encoder.blocks, strict=True):
        _copy_mha(tl.self_attn, None, None, xb.attn.out, xb.attn.qkv)
        for t, x in ((tl.linear1, xb.ffn.up), (tl.linear2, xb.ffn.down), (tl.norm1, xb.norm1), (tl.norm2, xb.norm2)):
            x.load_state_dict(t.state_dict())
    for tl, xb in zip(ref.decoder.layers, m.decoder.blocks, strict=True):
        _copy_mha(tl.self_attn, None, None, xb.attn.out, xb.attn.qkv)
        _copy_mha(tl.multihead_attn, xb.cross.q, xb.cross.kv, xb.cross.out, None)
        pairs = ((tl.linear1, xb.ffn.up), (tl.linear2, xb.ffn.down), (tl.norm1, xb.norm1))
        for t, x in (*pairs, (tl.norm2, xb.norm_cross), (tl.norm3, xb.norm2)):
            x.load_state_dict(t.state_dict())
    src, tgt, pad = batch()
    causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
    hidden = ref(
        m.encoder.embed(src),
        m.decoder.embed(tgt),
        tgt_mask=causal,
        src_key_padding_mask=~pad,
        memory_key_padding_mask=~pad,
    )
    expected = m.decoder.head(hidden)
    got = m(src, decoder_input_ids=tgt, key_padding=pad).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@torch.no_grad()
def test_pre_norm_equals_x_transformers_xtransformer():
    """x-transformers' ``XTransformer`` (pre-norm, final norms, GELU FFN with biases, attention without biases,
    head width 64): xfam with ``bias=true`` and the biases it has beyond those set to zero."""
    x_transformers = pytest.importorskip("x_transformers")
    torch.manual_seed(0)
    kw = dict(dim=32, enc_num_tokens=V, enc_depth=2, enc_heads=4, enc_max_seq_len=64, dec_num_tokens=V)
    ref = x_transformers.XTransformer(
        **kw, dec_depth=2, dec_heads=4, dec_max_seq_len=64, enc_use_abs_pos_emb=False, dec_use_abs_pos_emb=False
    ).eval()
    m = make("pre", bias=True, head_dim=64)
    gain = lambda norm: norm.gamma + float(norm.unit_offset)  # noqa: E731  (its norms store gamma - 1)
    for p in m.parameters():
        p.zero_()  # every bias x-transformers lacks stays 0; the rest is copied below
    m.encoder.embed.weight.copy_(ref.encoder.token_emb.emb.weight)
    m.decoder.embed.weight.copy_(ref.decoder.net.token_emb.emb.weight)
    m.decoder.head.weight.copy_(ref.decoder.net.to_logits.weight)
    for side, net in ((m.encoder, ref.encoder), (m.decoder, ref.decoder.net)):
        layers = list(net.attn_layers.layers)
        per_block = len(layers) // len(side.blocks)  # (a, f) or (a, c, f)
        for i, xb in enumerate(side.blocks):
            group = layers[i * per_block : (i + 1) * per_block]
            a, f = group[0], group[-1]
            xb.norm1.weight.copy_(gain(a[0][0]))
            xb.attn.qkv.weight.copy_(torch.cat([a[1].to_q.weight, a[1].to_k.weight, a[1].to_v.weight]))
            xb.attn.out.weight.copy_(a[1].to_out.weight)
            if per_block == 3:
                c = group[1]
                xb.norm_cross.weight.copy_(gain(c[0][0]))
                xb.cross.q.weight.copy_(c[1].to_q.weight)
                xb.cross.kv.weight.copy_(torch.cat([c[1].to_k.weight, c[1].to_v.weight]))
                xb.cross.out.weight.copy_(c[1].to_out.weight)
            xb.norm2.weight.copy_(gain(f[0][0]))
            xb.ffn.up.weight.copy_(f[1].ff[0][0].weight), xb.ffn.up.bias.copy_(f[1].ff[0][0].bias)
            xb.ffn.down.weight.copy_(f[1].ff[2].weight), xb.ffn.down.bias.copy_(f[1].ff[2].bias)
        side.norm.weight.copy_(gain(net.attn_layers.final_norm))
    src, tgt, pad = batch()
    enc = ref.encoder(src, mask=pad, return_embeddings=True)
    expected = ref.decoder.net(tgt, context=enc, context_mask=pad)
    got = m(src, decoder_input_ids=tgt, key_padding=pad).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


CROSS = sorted(name for name, cls in ATTENTION.items() if cls.cross_attention)


def test_the_mechanisms_that_declare_cross_attention():
    """Dense, low-rank and kernel mechanisms can attend over another sequence; patterns of positions cannot."""
    assert set(CROSS) == {"vanilla", "linformer", "performer", "rfa"}


@pytest.mark.parametrize("cross", CROSS)
@torch.no_grad()
def test_cached_decoding_equals_recomputation(cross):
    """Decoding token by token (encoder keys/values projected once, in the cache) gives the logits of one full
    forward pass, for every cross-attention mechanism; padded source tokens change nothing."""
    torch.manual_seed(0)
    m = make(cross={"name": cross, **({"k": 16} if cross == "linformer" else {})}, pos={"name": "rope"})
    src, tgt, pad = batch()
    full = m(src, decoder_input_ids=tgt, key_padding=pad).logits  # [B, St, V]
    out = m(src, decoder_input_ids=tgt[:, :2], key_padding=pad, cache=m.empty_cache())
    steps = [out.logits]
    projected = dict(out.cache.source.kv)
    for t in range(2, tgt.shape[1]):
        out = m(None, decoder_input_ids=tgt[:, t : t + 1], cache=out.cache)
        steps.append(out.logits)
        assert all(out.cache.source.kv[i][0] is projected[i][0] for i in projected)  # projected once
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
    src2 = src.clone()
    src2[-1, -2:] = (src2[-1, -2:] + 1) % V  # change the padded source tokens
    torch.testing.assert_close(m(src2, decoder_input_ids=tgt, key_padding=pad).logits, full, atol=1e-6, rtol=0)


@torch.no_grad()
def test_the_decoder_is_causal_and_reads_the_source():
    """A target token changes only later outputs; every output depends on the source (cross-attention works)."""
    torch.manual_seed(0)
    m = make()
    src, tgt, pad = batch()
    full = m(src, decoder_input_ids=tgt, key_padding=pad).logits
    tgt2 = tgt.clone()
    tgt2[:, 3] = (tgt2[:, 3] + 1) % V
    changed = m(src, decoder_input_ids=tgt2, key_padding=pad).logits
    torch.testing.assert_close(changed[:, :3], full[:, :3], atol=0, rtol=0)
    assert (changed[:, 3:] - full[:, 3:]).abs().amax() > 1e-4
    src2 = src.clone()
    src2[:, 0] = (src2[:, 0] + 1) % V
    moved = (m(src2, decoder_input_ids=tgt, key_padding=pad).logits - full).abs().amax(dim=-1)  # [B, St]
    assert (moved > 1e-6).all()


def test_tied_embeddings_are_one_matrix():
    """T5: the source embedding, the target embedding and the output layer share one matrix."""
    m = make(tie=True)
    assert m.encoder.embed.weight is m.decoder.embed.weight is m.decoder.head.weight
    assert sum(p.numel() for p in m.parameters()) < sum(p.numel() for p in make().parameters()) - 2 * V * 32 + 1


DECODERS = [{"name": n} for n, cls in sorted(ATTENTION.items()) if cls.causal] + [{"name": "local", "window": 3}]


@pytest.mark.parametrize("attention", DECODERS, ids=lambda a: "-".join(str(v) for v in a.values()))
@torch.no_grad()
def test_cached_decoding_with_each_decoder_self_attention(attention):
    """Every causal mechanism decodes the decoder with its own state (a key/value cache, a window, running sums,
    buckets) and equals one full pass; ``local window=3`` with a window shorter than the target."""
    torch.manual_seed(0)
    m = make(attention=attention, max_len=64 if attention.get("window") else 1024)  # (defaults fit 1024)
    src, tgt, pad = batch(st=7)
    full = m(src, decoder_input_ids=tgt, key_padding=pad).logits
    out, steps = None, []
    for t in range(tgt.shape[1]):
        cache = m.empty_cache() if out is None else out.cache
        out = m(src, decoder_input_ids=tgt[:, t : t + 1], key_padding=pad, cache=cache)
        steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("beam_size", [1, 3])
@torch.no_grad()
def test_beam_search_with_the_cache_equals_it_without(beam_size):
    """Beam search over the decode cache (reordered rows, cross keys/values projected once) returns what the same
    search returns when every step recomputes the decoder on the whole prefix; beam 1 is greedy."""
    from xfam.eval.beam import beam_search
    from xfam.eval.translate import translate

    torch.manual_seed(0)
    m = make()
    src, _, pad = batch(b=3)
    got = translate(m, src, pad, bos_id=0, eos_id=1, max_new_tokens=6, beam_size=beam_size, length_penalty=0.6)
    encoded = m.encode(src, pad)

    def step(last, state):  # state: (rows of the source [N], tokens so far [N, t])
        rows, seq = state
        seq = torch.cat((seq, last[:, None]), dim=1)
        source = encoded.index(rows)
        return m(None, decoder_input_ids=seq, encoded=source).logits[:, -1], (rows, seq)

    state = (torch.arange(3), torch.empty(3, 0, dtype=torch.long))
    reorder = lambda st, idx: (st[0][idx], st[1][idx])  # noqa: E731
    kw = dict(batch_size=3, bos_id=0, eos_id=1, max_len=6, beam_size=beam_size, length_penalty=0.6)
    want = beam_search(step, state, **kw, reorder=reorder)
    assert torch.equal(got.tokens, want.tokens)  # (beam_size 1: translate decodes greedily)
    if beam_size > 1:
        torch.testing.assert_close(got.scores, want.scores, atol=1e-5, rtol=0)
