"""Kernelised (linear) attention, shared by ``performer`` and ``rfa`` (Katharopoulos et al., 2020, eq. 4-9).

With a feature map phi, attention over the visible keys j of query i is

    o_i = phi(q_i)^T S_i / (phi(q_i)^T z_i),   S_i = sum_j w_ij phi(k_j) v_j^T,   z_i = sum_j w_ij phi(k_j)

* bidirectional: one global pair (S [B, H, m, Dh], z [B, H, m]) for all queries; with a distance decay
  exp(b_ij) = lambda_h^|i - j| (bidirectional ALiBi) or packed documents, an inclusive causal pass plus an
  inclusive anti-causal pass (the same engine on the reversed sequence) minus the diagonal counted twice;
* causal: the prefix recurrence S_t = a_t S_{t-1} + phi(k_t) v_t^T with a per-position decay a_t =
  exp(ld_t). A score bias exp(b_ij) = lambda_h^(i - j) (ALiBi: ``bias.decay()`` = exp(-m_h)) is
  log a_t = log lambda_h, RFA's gate is a_t = g_t; a_t = 0 at a document start (packed rows).
  Computed in chunks of C positions: inside a chunk explicitly (C x C weights), across chunks through
  the running sums, so memory is O(L (m + Dh + C) + (L / C) m Dh), linear in L. Fast path:
  ``ChunkedPrefix``, batched matmuls plus one in-place step per chunk for the chunk states, with a
  hand-written backward that keeps only the inputs, the C x C weights and the L / C chunk states;
* decoding keeps only the running sums ``{s, z, m}`` (no key/value cache).

Key features arrive as ``fk * exp(ls)`` (base features ``fk`` and a per-key log-scale ``ls``), so
unbounded scales (FAVOR+'s exp, RFA's exp(|k|^2 / 2 sigma^2)) never overflow: the causal engine
divides the state by exp(M_t), M_t the running max of ``ls`` up to t (kept in the state as ``m``),
which is itself a decay exp(M_{t-1} - M_t); a per-query factor, like any positive per-query
scale of phi(q), cancels in the ratio. ``KernelAttention`` is the mechanism base of both papers; the
sums it runs (``causal_sums``, ``bidirectional_sums``, ``quadratic``) are in ``xfam.attention._linear_sums``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

import xfam.kernels.runtime as runtime  # (a plain import: mypy cannot follow xfam.kernels, see pyproject)
from xfam.attention._base import AttentionMechanism
from xfam.attention._linear_sums import bidirectional_sums, causal_sums, doc_index, finish, gaussian_matrix, quadratic
from xfam.core.bias import ScoreBias, ScoreModifier
from xfam.core.errors import ConfigError
from xfam.core.logs import log_once
from xfam.core.mask import AttnMask
from xfam.core.state import DecodeState, expand_kv


class KernelAttention(AttentionMechanism):
    """Base of random-feature mechanisms: features (re)drawn on a schedule, three paths, running-sum decoding.

    Subclasses set ``features`` (``iid`` | ``orthogonal`` | ``exact``) and implement ``draw(generator)``
    (the ``[rows, Dh]`` random matrix), ``feature_maps(q, k)`` -> ``(fq, fk, ls, ld)`` with k on its
    own Hkv heads, and ``exact_logits(q, k)``. ``features=exact`` evaluates the kernel itself,
    exp(x . y), on the quadratic path: the m -> infinity limit, which is softmax attention.

    Redraw schedule: ``steps`` counts training steps (``new_step``, which the model calls once per training
    forward, so every run of the layer within a step, ACT's repeats and a reversible recomputation included,
    uses the same features; a buffer, so it survives checkpoints); the step that finds ``steps`` a positive
    multiple of ``redraw_every`` draws new features first. Draw r comes from a generator seeded by
    (``seed``, r), ``seed`` a buffer drawn from the global RNG at construction: resumes and data-parallel
    ranks get identical features.
    """

    hosts_modifiers = False
    accepts_bias = True  # only a distance decay lambda_h^|i-j| on the chunked path (see ``refusals``)
    shared_keys = False  # its prefix sums restart at every change of document id (``doc_index``)
    cross_attention = True  # bidirectional sums over the keys: any key length (RFA without its causal gate)
    backends: ClassVar[tuple[str, ...]] = ("chunked", "quadratic", "triton")
    seed: Tensor  # buffers (see above)
    steps: Tensor
    proj: Tensor  # the random features' projection

    def __init__(self, *, rows: int, head_dim: int, features: str, redraw_every: int | None, chunk: int, backend: str):
        super().__init__()
        self.features, self.redraw_every, self.chunk, self.backend = features, redraw_every, chunk, backend
        self.rows, self.head_dim = rows, head_dim
        self.register_buffer("seed", torch.randint(0, 2**62, ()))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("proj", self.draw(self._generator(0)))

    # -- features ---------------------------------------------------------------------------------
    def draw(self, gen: torch.Generator) -> Tensor:
        """The random matrix ``[rows, Dh]`` (drawn on the CPU; the buffer keeps its device and dtype)."""
        return gaussian_matrix(self.rows, self.head_dim, self.features == "orthogonal", gen)

    def feature_maps(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        raise NotImplementedError  # abstract

    def exact_logits(self, q: Tensor, k: Tensor) -> Tensor:
        raise NotImplementedError  # abstract

    def _generator(self, index: int) -> torch.Generator:
        return torch.Generator().manual_seed((int(self.seed) * 1_000_003 + index) % 2**63)

    def new_step(self) -> None:
        if self.redraw_every is None or self.features == "exact":
            return
        step = int(self.steps)
        if step > 0 and step % self.redraw_every == 0:
            self.proj.copy_(self.draw(self._generator(step // self.redraw_every)))
        self.steps += 1

    def _features(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        heads = q.shape[1]
        fq, fk, ls, ld = self.feature_maps(q, k)
        return fq, expand_kv(fk, heads), expand_kv(ls, heads), None if ld is None else expand_kv(ld, heads)

    # -- paths ------------------------------------------------------------------------------------
    def _chunked_blockers(self, mask: AttnMask, bias: ScoreBias | None) -> list[str]:
        out = ["a window mask"] if mask.window is not None else []
        if bias is not None and bias.decay() is None:
            out.append("a score bias that is not a distance decay")
        return out

    def _path(self, mask: AttnMask, bias: ScoreBias | None) -> str:
        name, blockers = self.registry_name, self._chunked_blockers(mask, bias)
        if self.backend == "quadratic":
            return "quadratic"
        if self.backend == "triton" and blockers:
            raise ConfigError(
                f"attention={name} backend=triton runs the chunked causal path in a kernel, and this call needs "
                f"the quadratic path for {' and '.join(blockers)}. Fix: attention.backend=auto."
            )
        if not blockers:
            log_once(f"attention={name} backend={self.backend}: chunked linear-attention path")
            return "chunked"
        # The quadratic path computes the same estimator, only in O(L^2): logged once, not an error.
        log_once(f"attention={name} backend={self.backend}: quadratic path (O(L^2)) for {' and '.join(blockers)}")
        return "quadratic"

    @staticmethod
    def _bias_decay(ld: Tensor | None, bias: ScoreBias | None, like: Tensor) -> Tensor | None:
        if bias is None:
            return ld
        decay = bias.decay()
        assert decay is not None  # (``refusals``: the only bias here is a decay)
        rate = torch.log(decay.to(like)).view(1, -1, 1)  # [1, H, 1]
        return rate if ld is None else ld + rate

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: AttnMask,
        bias: ScoreBias | None = None,
        modifier: ScoreModifier | None = None,
    ) -> Tensor:
        heads = q.shape[1]
        if self.features == "exact":
            logits = self.exact_logits(q, expand_kv(k, heads))
            ls, ld = self._gate(k, heads)
            v = expand_kv(v, heads)
            return finish(*quadratic(None, None, v, ls, ld, mask, bias, logits), mask.own_keys(v))
        fq, fk, ls, ld = self._features(q, k)
        v = expand_kv(v, heads)
        v_self = mask.own_keys(v)  # [B, H, Sq, Dh]
        if self._path(mask, bias) == "quadratic":
            return finish(*quadratic(fq, fk, v, ls, ld, mask, bias), v_self)
        keep, doc = mask.key_padding, doc_index(mask, q.device)
        keep = None if keep is None else keep.to(q.device)
        ld = self._bias_decay(ld, bias, fq)
        if not mask.causal:  # ld: the bias's per-head rate only (RFA's gate is causal-only)
            return finish(*bidirectional_sums(fq, fk, v, ls, keep, doc, self.chunk, ld), v_self)
        kernel = self._kernel(fq)
        num, den, _ = causal_sums(fq, fk, v, ls, ld, keep, doc, None, None, self.chunk, kernel=kernel)
        return finish(num, den, v_self)

    def _kernel(self, fq: Tensor) -> bool:
        """Whether the causal chunked path runs as the Triton kernel (``backend=triton``; ``auto``: on CUDA)."""
        c, name = self.chunk, self.registry_name
        why = None if c >= 16 and c & (c - 1) == 0 else f"chunk={c} (the kernel takes powers of two >= 16)"
        why = why or runtime.why_not(fq.device)
        if self.backend == "triton":
            if why is not None:
                raise ConfigError(f"attention={name} backend=triton: {why}. Fix: attention.backend=auto.")
            return True
        if self.backend == "auto" and fq.device.type == "cuda" and why is None:
            log_once(f"attention={name} backend=auto: Triton chunked linear-attention kernel (CUDA)")
            return True
        return False

    def _gate(self, k: Tensor, heads: int) -> tuple[Tensor | None, Tensor | None]:
        """Key log-scales and log-decays ``[B, H, Sk]`` of a learned gate (RFA-Gate), for the exact path."""
        return None, None

    def decode(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        state: DecodeState | None,
        mask: AttnMask,
        bias: ScoreBias | None = None,
        modifier: ScoreModifier | None = None,
    ) -> tuple[Tensor, DecodeState]:
        """Running sums ``{s, z, m}`` of the keys so far; the exact kernel or a window needs the key cache."""
        if self.features == "exact" or self._chunked_blockers(mask, bias):
            log_once(f"attention={self.registry_name}: decoding with a key/value cache (exact kernel or window)")
            return super().decode(q, k, v, state, mask, bias, modifier)
        fq, fk, ls, ld = self._features(q, k)
        off = mask.offset
        keep = None if mask.key_padding is None else mask.key_padding[:, off:].to(q.device)
        doc = doc_index(mask, q.device)
        doc0 = None if doc is None else doc[:, max(off - 1, 0)]
        doc = None if doc is None else doc[:, off:]
        ld = self._bias_decay(ld, bias, fq)
        v = expand_kv(v, q.shape[1])
        num, den, state = causal_sums(fq, fk, v, ls, ld, keep, doc, doc0, state, self.chunk)
        return finish(num, den, v[:, :, -q.shape[2] :]), state  # (a memory read in this call leads the keys)

    # -- fixed-shape decoding: the running sums are fixed-shape already --------------------------------
    def static_problem(self) -> str | None:
        if self.features == "exact":
            return f"attention={self.registry_name} features=exact decodes with a key/value cache (quadratic path)"
        return None

    def static_state(self, prefix: DecodeState, capacity: int) -> DecodeState | None:
        """The prompt's running sums ``{s [B, H, m, Dh], z [B, H, m], m [B, H]}``, copied (None: the prompt was
        decoded with a key/value cache, for a window or a bias that is not a distance decay)."""
        return None if "s" not in prefix else {key: t.clone() for key, t in prefix.items()}

    def decode_step(
        self, q: Tensor, k: Tensor, v: Tensor, state: DecodeState, pos: Tensor, bias: ScoreBias | None
    ) -> Tensor:
        """The recurrence of ``decode`` for one key: S_t = a_t S_{t-1} + phi(k_t) v_t^T, sums updated in place."""
        fq, fk, ls, ld = self._features(q, k)
        ld = self._bias_decay(ld, bias, fq)
        v = expand_kv(v, q.shape[1])
        num, den, new = causal_sums(fq, fk, v, ls, ld, None, None, None, state, self.chunk)
        for key, t in new.items():
            state[key].copy_(t)
        return finish(num, den, v)

    def static_write(self, k: Tensor, v: Tensor, state: DecodeState, pos: Tensor, bias: ScoreBias | None) -> None:
        """The running sums' update alone (the step's output, for a query equal to the key, is dropped)."""
        self.decode_step(expand_kv(k, state["s"].shape[1]), k, v, state, pos, bias)

    # -- validation -------------------------------------------------------------------------------
    @classmethod
    def refusals(cls, params: dict[str, Any], selection: Any) -> list[str]:
        chunk = params.get("chunk")
        if params.get("backend") == "triton" and isinstance(chunk, int) and (chunk < 16 or chunk & (chunk - 1)):
            return [  # (as ``_kernel`` refuses it in the first step)
                f"attention={cls.registry_name} backend=triton: chunk={chunk}, and the Triton kernel takes chunks "
                f"that are powers of two >= 16 (its tl.dot tiles). Fix: attention.chunk=16 (or 32, 64, ...), or "
                f"attention.backend=auto (the PyTorch chunked path takes any chunk)."
            ]
        if params.get("backend") == "triton" and (not selection.causal or params.get("features") == "exact"):
            return [
                f"attention={cls.registry_name} backend=triton is the causal chunked path as a kernel; this model "
                f"{'is bidirectional' if not selection.causal else 'uses features=exact (quadratic)'}. "
                f"Fix: attention.backend=auto."
            ]
        pos = selection.pos[0]
        if pos.kind != "bias" or params.get("features") == "exact":
            return []
        if pos.decays:
            return []
        hostable = lambda c: c.kind in ("none", "input", "rotary") or (c.kind == "bias" and c.decays)  # noqa: E731
        ok = selection.alternatives("pos", hostable)
        return [
            f"attention={cls.registry_name} adds a score bias only as a per-head distance decay of its prefix "
            f"sums (exp(b_ij) = lambda_h^|i-j|, e.g. ALiBi), and pos={pos.registry_name} is no such decay. "
            f"Alternatives: pos in [{', '.join(ok)}], or attention.features=exact (quadratic)."
        ]
