"""Which block options (docs/blocks.md) combine with which slots, and why not where they do not.

``reasons(spec, sel)`` is the one rule book: validation calls it through ``xfam.model.compat.check``, and
``compat.block_matrix()`` evaluates it over every option and attention mechanism for ``xfam list`` and the
docs. An option that only touches q, k, v, the heads' outputs, the FFN or the residual works with every
mechanism; one that changes the score matrix needs a mechanism that forms it; one that passes something
from layer to layer (RealFormer's scores, ResFormer's values, ResiDual's stream) or between the sublayers
of a block needs the ordinary layer-by-layer stack.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from xfam.model.attn_options import needs_scores
from xfam.model.spec import ModelSpec


@dataclasses.dataclass(frozen=True)
class BlockOption:
    """One block option as ``xfam list`` and docs/blocks.md show it: the override that turns it on, its paper,
    and what it changes."""

    override: dict[str, Any]
    paper: str
    what: str


#: Every block option, by the override that turns it on (besides the plain ``ffn``/``norm`` choices of before).
OPTIONS: dict[str, BlockOption] = {
    "norm=scalenorm": BlockOption(
        {"norm": "scalenorm"}, "Nguyen & Salazar, 2019, arXiv:1910.05895", "g x / ||x||, one learned g"
    ),
    "norm=simple_rmsnorm": BlockOption(
        {"norm": "simple_rmsnorm"}, "Zhang & Sennrich, 2019, arXiv:1910.07467", "RMSNorm without gain"
    ),
    "norm_position=sandwich": BlockOption(
        {"norm_position": "sandwich"}, "Ding et al., 2021 (CogView), arXiv:2105.13290", "x + N'(f(N(x)))"
    ),
    "norm_position=deepnorm": BlockOption(
        {"norm_position": "deepnorm"},
        "Wang et al., 2022 (DeepNet), arXiv:2203.00555",
        "N(alpha x + f(x)), beta-scaled init",
    ),
    "norm_position=resi_dual": BlockOption(
        {"norm_position": "resi_dual"},
        "Xie et al., 2023 (ResiDual), arXiv:2304.14802",
        "post-norm stream + dual sum stream",
    ),
    "post_emb_norm": BlockOption({"post_emb_norm": True}, "BLOOM, arXiv:2211.05100", "a norm after the embedding"),
    "l2norm_embed": BlockOption(
        {"l2norm_embed": True},
        "Nguyen & Chiang, 2018 (FixNorm), arXiv:1710.01329",
        "unit-norm embeddings, N(0, 1e-5) init",
    ),
    "residual=rezero": BlockOption(
        {"residual": "rezero"}, "Bachlechner et al., 2020, arXiv:2003.04887", "x + alpha f(x), alpha = 0, no norms"
    ),
    "residual=layerscale": BlockOption(
        {"residual": "layerscale"}, "Touvron et al., 2021 (CaiT), arXiv:2103.17239", "x + diag(lambda) f, lambda small"
    ),
    "residual=gtrxl": BlockOption(
        {"residual": "gtrxl"}, "Parisotto et al., 2019 (GTrXL), arXiv:1910.06764", "GRU gate g(x, ReLU(f))"
    ),
    "resid_scale": BlockOption(
        {"resid_scale": True}, "Shleifer et al., 2021 (NormFormer), arXiv:2110.09456", "lambda x + f on FFN sublayers"
    ),
    "layer_drop": BlockOption(
        {"layer_drop": 0.2}, "Huang et al., 2016, arXiv:1603.09382", "stochastic depth, linear schedule"
    ),
    "ffn=geglu": BlockOption({"ffn": "geglu"}, "Shazeer, 2020, arXiv:2002.05202", "(GELU(W x) * V x) W2"),
    "ffn=reglu": BlockOption({"ffn": "reglu"}, "Shazeer, 2020, arXiv:2002.05202", "(ReLU(W x) * V x) W2"),
    "ffn=relu2": BlockOption({"ffn": "relu2"}, "So et al., 2021 (Primer), arXiv:2109.08668", "ReLU(W x)^2 W2"),
    "ffn=sepconv": BlockOption(
        {"ffn": "sepconv"},
        "Dehghani et al., 2019 (Universal Transformers), arXiv:1807.03819",
        "sepconv-ReLU-sepconv transition, kernels 3, 5",
    ),
    "ffn_post_act_norm": BlockOption(
        {"ffn_post_act_norm": True}, "Shleifer et al., 2021 (NormFormer)", "a norm after the activation"
    ),
    "attn_qk_norm=l2": BlockOption(
        {"attn_qk_norm": "l2"}, "Henry et al., 2020, arXiv:2010.04245", "g cos(q, k) scores"
    ),
    "attn_qk_norm=rms": BlockOption(
        {"attn_qk_norm": "rms"}, "Dehghani et al., 2023 (ViT-22B), arXiv:2302.05442", "RMSNorm of q and k"
    ),
    "attn_talking_heads": BlockOption(
        {"attn_talking_heads": True}, "Shazeer et al., 2020, arXiv:2003.02436", "head mixing around the softmax"
    ),
    "residual_attn": BlockOption(
        {"residual_attn": True}, "He et al., 2020 (RealFormer), arXiv:2012.11747", "scores += previous layer's"
    ),
    "value_residual": BlockOption(
        {"value_residual": True}, "Zhou et al., 2024 (ResFormer), arXiv:2410.17897", "values (V_n + V_1) / 2"
    ),
    "attn_gate": BlockOption({"attn_gate": True}, "Jumper et al., 2021 (AlphaFold2)", "sigmoid gate on head outputs"),
    "attn_topk": BlockOption({"attn_topk": 8}, "Zhao et al., 2019, arXiv:1912.11637", "top-k scores per query"),
    "attn_on_attn": BlockOption(
        {"attn_on_attn": True}, "Huang et al., 2019, arXiv:1908.06954", "gated info from [attended; query]"
    ),
    "attn_head_scale": BlockOption(
        {"attn_head_scale": True}, "Shleifer et al., 2021 (NormFormer)", "learned scale per head"
    ),
    "attn_post_norm": BlockOption(
        {"attn_post_norm": True}, "Shleifer et al., 2021 (NormFormer)", "a norm of the attention output"
    ),
    "macaron": BlockOption({"macaron": True}, "Lu et al., 2019, arXiv:1906.02762", "FFN/2 - attention - FFN/2"),
    "sandwich_coef": BlockOption({"sandwich_coef": 1}, "Press et al., 2020, arXiv:1911.03864", "a^k (af)^(L-k) f^k"),
    "layer_order": BlockOption({"layer_order": "aaffaaff"}, "x-transformers' custom_layers", "any a/f order"),
    "shift_tokens": BlockOption(
        {"shift_tokens": 1}, "Peng et al. (RWKV); x-transformers", "channel groups shifted in time"
    ),
    "share_layers": BlockOption(
        {"share_layers": True}, "Lan et al., 2019 (ALBERT), arXiv:1909.11942", "one block's weights at every layer"
    ),
    "forgetful_mask": BlockOption(
        {"forgetful_mask": 0.15}, "Liu et al., 2022 (FCM), arXiv:2210.13432", "random past keys hidden in training"
    ),
}


def _layout_changed(spec: ModelSpec) -> bool:
    return bool(spec.macaron or spec.sandwich_coef or spec.layer_order)


def _layout_fields(spec: ModelSpec) -> str:
    """The override(s) that set a non-default sublayer order, as a user wrote them."""
    fields = (("macaron", spec.macaron), ("sandwich_coef", spec.sandwich_coef), ("layer_order", spec.layer_order))
    return " ".join(f"model.{n}={v!r}".replace("True", "true") for n, v in fields if v) or "the sublayer order"


def _differ(configs: list[dict[str, Any]]) -> bool:
    return len({repr(sorted(c.items())) for c in configs}) > 1


def reasons(spec: ModelSpec, sel: Any) -> list[str]:
    """Every combination of ``spec``'s block options with the selection ``sel`` (``xfam.model.compat.Selection``)
    that cannot work, each with the reason and the fix."""
    out = []
    scores = needs_scores(spec)
    if scores:
        names = ", ".join(f"model.{n}" for n in scores)
        bad = sorted({a.registry_name for a, _, _ in sel.attention if not a.hosts_modifiers})
        if bad:
            ok = ", ".join(sel.alternatives("attention", lambda c: c.hosts_modifiers))
            out.append(
                f"{names} change(s) the attention score matrix, which attention={', '.join(bad)} never forms. "
                f"Fix: attention in [{ok}], or turn {names} off."
            )
        fast = sorted({p.get("backend") for a, p, _ in sel.attention if p.get("backend") in ("sdpa", "triton")})
        if fast:
            out.append(
                f"{names} need explicit scores, which attention.backend={fast[0]} never materialises. "
                f"Fix: attention.backend=auto (the explicit-score path where these options are on) or torch."
            )
        if any(per_head for _, _, per_head in sel.attention):
            out.append(
                f"{names} act on all heads' scores together, and a per_head schedule splits the heads between "
                f"mechanisms. Fix: one attention for all heads, or turn {names} off."
            )
    if spec.residual_attn and _differ([p for _, p in sel.memory]):
        out.append(
            "model.residual_attn=true adds each layer's scores to the next layer's, so every layer must see the "
            "same keys; a per_layer memory schedule gives layers different memories. Fix: one memory config for "
            "all layers, or residual_attn=false."
        )
    if spec.value_residual and sel.has_memory:
        out.append(
            "model.value_residual=true mixes the first layer's values of the same keys into every layer; memory keys "
            "in front are each layer's own states, whose first-layer values no layer kept. Fix: memory=none, or "
            "model.value_residual=false."
        )
    if spec.shift_tokens and sel.has_memory:
        out.append(
            f"model.shift_tokens={spec.shift_tokens} shifts features from earlier rows, and with memory a segment's "
            f"first rows would need the previous segment's last rows, which memory does not keep per sublayer. "
            f"Fix: memory=none, or model.shift_tokens=0."
        )
    out += _sepconv_reasons(spec, sel)
    if spec.forgetful_mask and not sel.causal:
        out.append(
            f"model.forgetful_mask={spec.forgetful_mask} is the forgetful *causal* mask (it hides past tokens from "
            f"later queries), and this model is bidirectional (its task, or an attention that cannot be causal: "
            f"{', '.join(sorted({a.registry_name for a, _, _ in sel.attention}))}). Fix: model.forgetful_mask=0, or a "
            f"causal language model with an attention that can be causal."
        )
    if spec.share_layers and _differ([p for _, p, _ in sel.attention] + [p for _, p in sel.cross]):
        out.append(
            "model.share_layers=true runs one block's weights at every layer, and the attention config differs "
            "between layers (a per_layer schedule). Fix: one attention config for all layers, or share_layers=false."
        )
    if spec.norm_position == "resi_dual" and not sel.exit[0].full_stack:
        out.append(
            f"model.norm_position=resi_dual forms its output from two streams at the last layer, and "
            f"exit={sel.exit[0].registry_name} reads outputs at other depths. Fix: exit=none, or another "
            f"model.norm_position."
        )
    if sel.reversible:
        what = [
            (f"model.residual={spec.residual}", spec.residual == "gtrxl", "a gate is not an invertible sum"),
            ("model.resid_scale", spec.resid_scale, "the reversible block inverts x + f, not lambda x + f"),
            ("model.layer_drop", spec.layer_drop > 0, "the recomputed pass does not redraw the dropped samples"),
            ("model.residual_attn", spec.residual_attn, "scores passed between layers are not recomputed"),
            ("model.value_residual", spec.value_residual, "first-layer values are not recomputed"),
            ("model.shift_tokens", spec.shift_tokens > 0, "the reversible functions see one sublayer at a time"),
            ("model.ffn=sepconv", spec.ffn == "sepconv", "its FFN function sees neither padding nor documents"),
            (_layout_fields(spec), _layout_changed(spec), "it runs exactly one attention and one FFN per layer"),
            ("model.share_layers", spec.share_layers, "it runs each layer's own block once, in one pass"),
            (
                "model.checkpoint_activations",
                spec.checkpoint_activations,
                "the reversible stack already recomputes every layer in the backward pass",
            ),
        ]
        for name, on, why in what:
            if on:
                out.append(f"{name} with model.reversible=true: {why}. Fix: model.reversible=false, or drop {name}.")
    return out


def _sepconv_reasons(spec: ModelSpec, sel: Any) -> list[str]:
    """The Universal Transformer's convolutional transition (``xfam.model.sepconv``): odd kernels, no memory."""
    out = []
    kernels = {"sepconv_kernel1": spec.sepconv_kernel1, "sepconv_kernel2": spec.sepconv_kernel2}
    if spec.ffn != "sepconv":
        changed = [f"model.{n}={k}" for n, k in kernels.items() if k != _DEFAULT_KERNELS[n]]
        if changed:
            out.append(f"{', '.join(changed)} applies to model.ffn=sepconv. Fix: model.ffn=sepconv, or drop it.")
        return out
    for name, k in kernels.items():
        if k % 2 == 0:
            out.append(
                f"model.{name}={k} must be odd: the convolution pads (k - 1) / 2 rows on each side when "
                f"bidirectional and k - 1 in front when causal, as the Universal Transformer's code does. "
                f"Fix: model.{name}={k + 1} (or {k - 1})."
            )
    if sel.has_memory:
        out.append(
            "model.ffn=sepconv convolves along the sequence, and with memory a segment's first rows would need the "
            "previous segment's last rows, which memory does not keep per sublayer. Fix: memory=none, or another "
            "model.ffn."
        )
    return out


_DEFAULT_KERNELS = {f.name: f.default for f in dataclasses.fields(ModelSpec) if f.name.startswith("sepconv_kernel")}
