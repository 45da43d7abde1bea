"""The sublayer layout of the blocks and the rules between block options (docs/blocks.md).

A model has ``layers`` attention sublayers; block i is the i-th of them with the FFN sublayers around it:

* default: ``af`` per block;
* ``macaron``: ``faf`` per block, each FFN a half step (Lu et al., 2019, arXiv:1906.02762);
* ``sandwich_coef`` k: ``a^k (af)^(L-k) f^k`` (Press et al., 2020, "Improving Transformer Models by
  Reordering their Sublayers", arXiv:1911.03864): the first k blocks have no FFN, the last has 1 + k;
* ``layer_order``: any string of ``a`` and ``f`` with L a's; each block is one ``a`` with the f's after it
  (f's before the first ``a`` belong to block 0, in front of its attention).

So memory, the exit slot and the decode cache keep seeing L layers, whatever the sublayer order.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """FFN sublayers before (``before``) and after (``after``) a block's attention, and their step size."""

    before: int = 0
    after: int = 1
    half: bool = False


DEFAULT_LAYOUT = BlockLayout()  # one FFN after the attention


def sublayer_order(spec: Any) -> str:
    """The whole stack's sublayer string (``a``/``f``)."""
    layers = spec.layers
    if spec.layer_order:
        return spec.layer_order
    if spec.macaron:
        return "faf" * layers
    if spec.sandwich_coef:
        k = spec.sandwich_coef
        return "a" * k + "af" * (layers - k) + "f" * k
    return "af" * layers


def block_layouts(spec: Any) -> list[BlockLayout]:
    """One ``BlockLayout`` per attention sublayer of ``sublayer_order``."""
    if spec.macaron:
        return [BlockLayout(1, 1, half=True)] * spec.layers
    order = sublayer_order(spec)
    lead = len(order) - len(order.lstrip("f"))
    groups = order[lead:].split("a")[1:]  # the f's after each a
    return [BlockLayout(lead if i == 0 else 0, len(g)) for i, g in enumerate(groups)]


def block_problems(spec: Any) -> list[str]:
    """Rules between the block options of one ``ModelSpec`` (each field's own range is checked elsewhere)."""
    out = []
    if spec.layer_order is not None:
        bad = sorted(set(spec.layer_order) - {"a", "f"})
        if bad or spec.layer_order.count("a") != spec.layers:
            out.append(
                f"model.layer_order={spec.layer_order!r} must be a string of 'a' (attention) and 'f' (FFN) with "
                f"exactly model.layers={spec.layers} a's (it has {spec.layer_order.count('a')}"
                + (f" and the characters {bad}" if bad else "")
                + f"). Fix: e.g. model.layer_order={'af' * spec.layers!r}, or set model.layers to its count of a's."
            )
    layouts = [
        n
        for n, on in (
            ("macaron", spec.macaron),
            ("sandwich_coef", spec.sandwich_coef),
            ("layer_order", spec.layer_order),
        )
        if on
    ]
    if len(layouts) > 1:
        out.append(f"model.{' and model.'.join(layouts)} each set the sublayer order. Fix: keep one of them.")
    if spec.sandwich_coef > spec.layers:
        out.append(
            f"model.sandwich_coef={spec.sandwich_coef} is more than model.layers={spec.layers} (the order is "
            f"a^k (af)^(L-k) f^k). Fix: sandwich_coef in 0..{spec.layers}."
        )
    if spec.share_layers and (spec.sandwich_coef or spec.layer_order):
        out.append(
            "model.share_layers=true shares one block's weights, but this sublayer order gives blocks different "
            "numbers of FFNs. Fix: model.share_layers=false, or the default or macaron order."
        )
    if spec.residual == "rezero" and spec.norm_position != "pre":
        out.append(
            f"model.residual=rezero removes the blocks' norms (x + alpha f(x), Bachlechner et al., 2020), so "
            f"model.norm_position={spec.norm_position} has nothing to place. Fix: model.norm_position=pre."
        )
    if spec.residual in ("layerscale", "gtrxl") and not spec.pre_norm:
        why = (
            "scales the branch of a pre-norm block"
            if spec.residual == "layerscale"
            else ("gates the branch of a pre-norm block (its identity-map reordering)")
        )
        out.append(
            f"model.residual={spec.residual} {why}; model.norm_position={spec.norm_position} normalises the stream "
            f"itself. Fix: model.norm_position=pre."
        )
    if spec.norm_position == "resi_dual" and spec.residual != "add":
        out.append(
            f"model.norm_position=resi_dual keeps two residual streams of plain sums; model.residual={spec.residual} "
            f"changes how a branch joins one. Fix: model.residual=add."
        )
    if spec.residual == "gtrxl" and spec.resid_scale:
        out.append("model.resid_scale scales an additive residual; residual=gtrxl gates it. Fix: resid_scale=false.")
    if spec.layerscale_init is not None and spec.residual != "layerscale":
        out.append("model.layerscale_init applies to model.residual=layerscale. Fix: layerscale_init=null.")
    if spec.attn_qk_scale is not None and spec.attn_qk_norm != "l2":
        out.append(
            "model.attn_qk_scale is the temperature of cosine-similarity attention. Fix: model.attn_qk_norm=l2, "
            "or attn_qk_scale=null."
        )
    if spec.attn_topk_straight_through and spec.attn_topk is None:
        out.append("model.attn_topk_straight_through needs model.attn_topk. Fix: set attn_topk (e.g. 8).")
    if spec.attn_post_norm and spec.norm_position == "sandwich":
        out.append(
            "model.attn_post_norm normalises the attention output, which norm_position=sandwich already does. "
            "Fix: model.attn_post_norm=false."
        )
    return out
