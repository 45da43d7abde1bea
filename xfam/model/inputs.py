"""Input embedders: what turns one call's inputs into the rows ``[B, S, D]`` the layer stack runs on.

The data declares its inputs (``DataSource.inputs``, a plain dict stored in checkpoints as
``data_info["inputs"]``; a checkpoint without one read token ids), and the model builds the embedder
that takes them:

* ``{"kind": "tokens"}``: token ids ``[B, S]`` through ``nn.Embedding`` (every text and synthetic source).
* ``{"kind": "vectors", "dim": F}``: continuous vectors ``[B, S, F]`` through ``VectorEmbedding``, one
  linear map ``R^F -> R^D`` applied at every position: the continuous-input wrapper of ``task=regress``
  (the Decision Transformer embeds its returns, states and actions with the same module).
* ``{"kind": "decision", ...}``: windows of K trajectory timesteps ``[B, K, F]`` (``xfam.core.trajectory``) through
  ``DecisionEmbedding``, the Decision Transformer's input (Chen et al., 2021, "Decision Transformer: Reinforcement
  Learning via Sequence Modeling", arXiv:2106.01345, sec. 3): each timestep makes three tokens, interleaved
  ``R_1, s_1, a_1, R_2, ...`` (3K rows; without returns, behaviour cloning, ``s_1, a_1, ...``), each modality with
  its own embedding (a ``VectorEmbedding`` for the return-to-go and for continuous states and actions, an
  ``nn.Embedding`` for discrete ones), plus the paper's timestep embedding, one learned vector per step of the
  episode (absolute, not a position in the window), added to all three tokens of a step. The model is causal and
  predicts a_t at the token s_t (``StepLayout.state_rows``): it sees R_1..R_t, s_1..s_t, a_1..a_{t-1}, never
  a_t or later.
* ``{"kind": "image", "channels": C, "height": H, "width": W}``: images ``[B, C, H, W]`` through
  ``PatchEmbedding``, the Vision Transformer's input (Dosovitskiy et al., 2020, "An Image is Worth 16x16
  Words: Transformers for Image Recognition at Scale", arXiv:2010.11929, sec. 3.1, eq. 1): the image is cut
  into N = HW / P^2 non-overlapping P x P patches in raster order, each flattened to a vector of C P^2
  values and mapped by one linear projection E (a ``VectorEmbedding``); with ``model.pool=cls`` a learned
  class token x_class is put in front, z_0 = [x_class; x_p^1 E; ...; x_p^N E], and the classifier reads its
  final state (``XfamModel.head_logits`` pools the first row); with ``model.pool=mean`` there is none and
  the classifier averages the patches' states. Positions (the ``pos`` slot) are added to these rows as to
  tokens: the paper's learned 1D position embeddings are ``pos=learned``.

``P`` is ``model.patch_size``; ``input_problems`` refuses, before anything is built, what cannot work
with continuous inputs (a size that does not divide the image, the options that read token ids).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import Tensor, nn

from xfam.core.trajectory import StepLayout
from xfam.model.spec import ModelSpec

#: The inputs of a source that declares none, and of a checkpoint written before inputs were recorded.
TOKENS: dict[str, Any] = {"kind": "tokens"}
KINDS = ("tokens", "vectors", "image", "decision")


def inputs_of(info: Mapping[str, Any] | None) -> dict[str, Any]:
    """The input description of a ``data_info`` (``TOKENS`` when it has none)."""
    return dict((info or {}).get("inputs") or TOKENS)


class VectorEmbedding(nn.Module):
    """Continuous vectors to model rows: ``[..., F] -> [..., D]``, one linear map (with a bias: the learned
    offset a token embedding has per id) shared by every position. Usable on its own, e.g. one per
    modality of an interleaved sequence."""

    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.in_dim = in_dim
        self.proj = nn.Linear(in_dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_dim:
            raise ValueError(f"VectorEmbedding takes vectors of {self.in_dim} values; got shape {tuple(x.shape)}")
        return self.proj(x.to(self.proj.weight.dtype))  # [..., D]


def patchify(images: Tensor, patch: int) -> Tensor:
    """``[B, C, H, W] -> [B, N, C P^2]``: the non-overlapping ``patch`` x ``patch`` patches in raster order
    (row by row), each flattened channel-major (c, i, j), so the projection equals a stride-P convolution."""
    b, c, h, w = images.shape
    if h % patch or w % patch:
        raise ValueError(f"images of {h}x{w} cannot be cut into {patch}x{patch} patches (model.patch_size)")
    x = images.reshape(b, c, h // patch, patch, w // patch, patch)  # [B, C, H/P, P, W/P, P]
    x = x.permute(0, 2, 4, 1, 3, 5)  # [B, H/P, W/P, C, P, P]
    return x.reshape(b, (h // patch) * (w // patch), c * patch * patch)  # [B, N, C P^2]


class PatchEmbedding(nn.Module):
    """The ViT's patch embedding: ``[B, C, H, W] -> [B, N (+1), D]`` (module docstring); ``cls_token``: a
    learned class token in front of the N patches (initialised at zero, as in the paper's code)."""

    def __init__(self, channels: int, patch: int, dim: int, *, cls_token: bool):
        super().__init__()
        self.patch = patch
        self.vectors = VectorEmbedding(channels * patch * patch, dim)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim)) if cls_token else None

    def forward(self, images: Tensor) -> Tensor:
        x = self.vectors(patchify(images, self.patch))  # [B, N, D]
        if self.cls is None:
            return x
        return torch.cat((self.cls.to(x.dtype).expand(x.shape[0], -1, -1), x), dim=1)  # [B, 1 + N, D]


class DecisionEmbedding(nn.Module):
    """The Decision Transformer's embedding (module docstring): ``[B, K, F]`` packed timesteps -> ``[B, n K, D]``
    interleaved tokens ``(R_1,) s_1, a_1, (R_2,) s_2, ...``."""

    def __init__(self, layout: StepLayout, dim: int):
        super().__init__()
        self.layout = layout
        self.returns = VectorEmbedding(1, dim) if layout.returns else None
        state_dim, action_dim = layout.state_dim, layout.action_dim
        # (a layout has state_dim or state_vocab, action_dim or num_actions)
        states, actions = cast(int, layout.state_vocab), cast(int, layout.num_actions)
        self.states = VectorEmbedding(state_dim, dim) if state_dim else nn.Embedding(states, dim)
        self.actions = VectorEmbedding(action_dim, dim) if action_dim else nn.Embedding(actions, dim)
        self.timesteps = nn.Embedding(layout.max_timestep, dim)

    def forward(self, x: Tensor) -> Tensor:
        returns, states, actions, steps = self.layout.unpack(x)
        time = self.timesteps(steps)  # [B, K, D]
        tokens = [self.states(states) + time, self.actions(actions) + time]
        if self.returns is not None:
            tokens.insert(0, self.returns(returns) + time)
        return torch.stack(tokens, dim=2).flatten(1, 2)  # [B, n K, D]: (R_1,) s_1, a_1, (R_2,) s_2, ...


def input_embedding(
    inputs: Mapping[str, Any], spec: ModelSpec, vocab_size: int
) -> nn.Embedding | VectorEmbedding | PatchEmbedding | DecisionEmbedding:
    """The embedder of ``inputs`` (a description, module docstring) for a model of ``spec``."""
    kind = inputs["kind"]
    if kind == "vectors":
        return VectorEmbedding(inputs["dim"], spec.dim)
    if kind == "image":
        return PatchEmbedding(inputs["channels"], spec.patch_size, spec.dim, cls_token=spec.pool == "cls")
    if kind == "decision":
        return DecisionEmbedding(StepLayout.of(inputs), spec.dim)
    return nn.Embedding(vocab_size, spec.dim)


def input_rows(inputs: Mapping[str, Any], spec: ModelSpec) -> int | None:
    """Rows one example makes (an image's patches, and its class token; a trajectory window's tokens): None where
    the data's ``seq_len`` says it (tokens, vectors)."""
    if inputs["kind"] not in ("decision", "image"):
        return None
    return example_rows(inputs, spec)


def example_rows(inputs: Mapping[str, Any], spec: ModelSpec) -> int:
    """``input_rows`` of an image or a trajectory window."""
    if inputs["kind"] == "decision":  # 3 tokens per timestep (2 without returns), data.context timesteps
        return (3 if inputs.get("returns", True) else 2) * inputs["context"]
    return (inputs["height"] // spec.patch_size) * (inputs["width"] // spec.patch_size) + (spec.pool == "cls")


def input_problems(inputs: Mapping[str, Any], spec: ModelSpec, data: str, bounded_pos: bool) -> list[str]:
    """What cannot work with the inputs of ``data=<data>``: a patch size that does not divide the image,
    more patches than a learned position table holds, and the model options that read token ids."""
    kind = inputs["kind"]
    if kind == "tokens":
        return []
    what = {"vectors": "vectors", "image": "images", "decision": "trajectories"}[kind]
    out = []
    if kind == "decision" and bounded_pos and (rows := example_rows(inputs, spec)) > spec.max_len:
        out.append(
            f"data.context={inputs['context']} timesteps of data={data} make {rows} tokens "
            f"({rows // inputs['context']} per step: return, state, action), more than the learned position table "
            f"(model.max_len={spec.max_len}). "
            f"Fix: model.max_len={rows} or more, a shorter data.context, or pos=none (the Decision Transformer's "
            f"timestep embedding already places every token)."
        )
    if kind == "image":
        h, w, p = inputs["height"], inputs["width"], spec.patch_size
        if h % p or w % p:
            sizes = [d for d in range(1, min(h, w) + 1) if h % d == 0 and w % d == 0]
            out.append(
                f"model.patch_size={p} does not divide the {h}x{w} images of data={data}: the ViT cuts each image "
                f"into non-overlapping {p}x{p} patches. Fix: model.patch_size in {sizes}."
            )
        elif bounded_pos and (rows := example_rows(inputs, spec)) > spec.max_len:
            out.append(
                f"the {h}x{w} images of data={data} make {rows} rows of {p}x{p} patches"
                + (" (and the class token)" if spec.pool == "cls" else "")
                + f", more than the learned position table (model.max_len={spec.max_len}). Fix: "
                f"model.max_len={rows} or more, a larger model.patch_size, or a pos that extrapolates (pos=rope)."
            )
    token_options = {
        "tie_embeddings": "ties the output layer to the token embedding matrix",
        "l2norm_embed": "l2-normalises the token embeddings",
    }
    for key, does in token_options.items():
        if getattr(spec, key):
            out.append(
                f"model.{key}=true {does}, and data={data} gives {what}, embedded by a linear map, not token ids. "
                f"Fix: model.{key}=false."
            )
    if spec.vocab_size is not None:
        out.append(
            f"model.vocab_size={spec.vocab_size} sizes a token embedding, and data={data} gives {what}, not token "
            f"ids. Fix: model.vocab_size=null."
        )
    return out
