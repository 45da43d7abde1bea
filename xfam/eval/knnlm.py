"""Building a datastore from a checkpoint and scoring a split with kNN-LM (what ``xfam knnlm`` runs).

Both loops read the checkpoint's data exactly as ``xfam eval`` does (``split_loader``: rows in order,
no shuffling), so the i-th target position of a split is row i of a store built from it; that is how
evaluation on the store's own split excludes each token's own entry.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from xfam.core.errors import ConfigError
from xfam.eval.metrics import summarize
from xfam.knnlm.datastore import Datastore, DatastoreWriter, Neighbours, checkpoint_identity, read_manifest
from xfam.knnlm.interpolate import check_knn_options, interpolate, knn_log_probs, knn_target_log_probs
from xfam.knnlm.keys import KeyCapture, check_supported

if TYPE_CHECKING:
    from xfam.model.transformer import XfamModel

#: Elements of one [rows, V] distribution tensor when accuracy needs whole distributions.
ROWS_BUDGET = 1 << 22


def load_checked(ckpt: str | Path, device: str) -> tuple[XfamModel, dict[str, Any], dict[str, Any]]:
    """The checkpoint's model (refused if kNN-LM does not apply to it), metadata and identity."""
    from xfam.model.checkpoint import load_model
    from xfam.model.transformer import XfamModel

    model, meta = load_model(ckpt, device)
    check_supported(model)
    assert isinstance(model, XfamModel)  # (check_supported: a language model)
    return model, meta, checkpoint_identity(ckpt, model, meta["config"])


def default_store_dir(ckpt: str | Path, split: str) -> Path:
    """``<run dir>/knnlm/<checkpoint name>_<split>`` (beside the run's checkpoints folder)."""
    ckpt = Path(ckpt).resolve()
    return ckpt.parent.parent / "knnlm" / f"{ckpt.stem}_{split}"


def batches(
    model: XfamModel, meta: dict[str, Any], split: str, batch_size: int | None, limit: int | None, device: str
) -> Iterator[tuple[dict[str, Tensor], Tensor, Tensor]]:
    """``(batch, logits [B, S, V], keys [B, S, D])`` over the first ``limit`` batches of ``split``, with a
    progress bar; a model with memory carries it from batch to batch, as in its training."""
    from xfam.eval.loop import split_outputs

    with torch.no_grad(), KeyCapture(model) as capture:
        for batch, out in split_outputs(model, meta, split, batch_size, limit, device, "kNN-LM"):
            yield batch, out.logits, capture.take()


def build_datastore(
    ckpt: str | Path,
    split: str = "train",
    out: str | Path | None = None,
    *,
    limit: int | None = None,
    batch_size: int | None = None,
    device: str = "cpu",
    dtype: str = "float16",
    overwrite: bool = False,
) -> Path:
    """Keys and next tokens of every target position of ``split`` (its first ``limit`` batches) into
    ``out`` (default ``default_store_dir``); returns the directory."""
    model, meta, identity = load_checked(ckpt, device)
    out = Path(out) if out is not None else default_store_dir(ckpt, split)
    writer = DatastoreWriter(out, model.spec.dim, dtype, overwrite=overwrite)
    n_batches = 0
    for batch, _, keys in batches(model, meta, split, batch_size, limit, device):
        keep = batch["labels"] != -100  # [B, S]: positions with a next token
        writer.add(keys[keep], batch["labels"][keep])
        n_batches += 1
    return writer.finish(
        checkpoint=identity,
        split=split,
        batches=n_batches,
        batch_size=batch_size or meta["config"]["data"]["batch_size"],
        limit=limit,
        data_fingerprint=meta["data_info"].get("fingerprint"),
        vocab_size=meta["data_info"].get("vocab_size"),
        key="input of the final layer's FFN (after its norm in a pre-norm block)",
        distance="squared L2",
    )


class KnnScorer:
    """Sums of the base model's and of kNN-LM's statistics over target tokens, for every ``k`` in ``ks``
    and λ in ``lambdas`` at once (one search with the largest k; results are sorted, so smaller k are
    prefixes). ``exclude_self``: the scored split is the store's, a token must not retrieve its own row."""

    def __init__(
        self,
        store: Datastore,
        ks: Sequence[int],
        lambdas: Sequence[float],
        temperature: float = 1.0,
        *,
        exclude_self: bool = False,
        token_bytes: Tensor | None = None,
        accuracy: bool = True,
    ):
        for k, lam in itertools.product(ks, lambdas):
            check_knn_options(k, lam, temperature)
        self.store, self.ks, self.lambdas, self.temperature = store, sorted(set(ks)), list(lambdas), temperature
        self.exclude, self.token_bytes, self.accuracy = exclude_self, token_bytes, accuracy
        self.offset = 0  # target positions of the split seen so far = the store row of the next one
        self.base: dict[str, Tensor] = {}
        self.mixed: dict[tuple[int, float], dict[str, Tensor]] = {(k, lam): {} for k in self.ks for lam in lambdas}
        self.coverage: dict[int, Tensor] = {k: torch.zeros((), dtype=torch.float64) for k in self.ks}

    def _self_rows(self, y: Tensor) -> Tensor | None:
        if not self.exclude:
            return None
        rows = torch.arange(self.offset, self.offset + len(y), device=y.device)  # [N]
        inside = rows < self.store.size
        if not torch.equal(self.store.values.to(y.device)[rows[inside]], y[inside]):
            raise ConfigError(
                f"the {self.store.manifest['split']} split's tokens are not in the order of the datastore "
                f"{self.store.path} (the data changed since it was built, or a model with memory read its "
                f"contiguous streams in batches of another size?), so a token's own entry cannot be "
                f"excluded. Fix: rebuild the datastore (xfam knnlm build) with the batch size used here, "
                f"or evaluate on another split."
            )
        return torch.where(inside, rows, -1)

    def add(self, batch: dict[str, Tensor], logits: Tensor, keys: Tensor) -> None:
        """One batch: ``logits [B, S, V]``, ``keys [B, S, D]``, ``batch["labels"] [B, S]`` (-100: none)."""
        keep = batch["labels"] != -100  # [B, S]
        y, q = batch["labels"][keep], keys[keep]  # [N], [N, D]
        lm = F.log_softmax(logits[keep].float(), dim=-1)  # [N, V]
        lm_y = lm.gather(1, y.unsqueeze(1)).squeeze(1)  # [N]
        nb = self.store.search(q, self.ks[-1], self._self_rows(y))
        self.offset += len(y)
        extra = {"count": torch.tensor(float(len(y)), dtype=torch.float64)}
        if self.token_bytes is not None and self.token_bytes.numel():
            extra["bytes"] = self.token_bytes.to(y.device)[y].double().sum().cpu()
        self._add(self.base, lm_y, lm.argmax(-1) == y if self.accuracy else None, extra)
        for k in self.ks:
            top = nb.first(k)
            knn_y = knn_target_log_probs(top.dists, top.values, y, self.temperature)  # [N]
            self.coverage[k] += (top.values == y.unsqueeze(1)).any(1).double().sum().cpu()
            for lam in self.lambdas:
                hits = self._argmax_hits(lm, top, y, lam) if self.accuracy else None
                self._add(self.mixed[(k, lam)], interpolate(lm_y, knn_y, lam), hits, extra)

    def _argmax_hits(self, lm: Tensor, top: Neighbours, y: Tensor, lam: float) -> Tensor:
        """Whether the interpolated distribution's top-1 is the target, ``[N]`` (in row chunks)."""
        step = max(1, ROWS_BUDGET // lm.shape[1])
        out = []
        for i in range(0, len(y), step):
            knn = knn_log_probs(top.dists[i : i + step], top.values[i : i + step], lm.shape[1], self.temperature)
            out.append(interpolate(lm[i : i + step], knn, lam).argmax(-1) == y[i : i + step])
        return torch.cat(out)

    @staticmethod
    def _add(sums: dict[str, Tensor], log_p: Tensor, hits: Tensor | None, extra: dict[str, Tensor]) -> None:
        stats = {"nll": -log_p.double().sum().cpu(), **extra}
        stats["correct"] = hits.double().sum().cpu() if hits is not None else torch.zeros((), dtype=torch.float64)
        for key, v in stats.items():
            sums[key] = sums.get(key, 0) + v

    def metrics(self, prefix: str) -> dict[Any, dict[str, float]]:
        """``{"base": {...}, (k, λ): {...}}``: loss, ppl, bpb (byte-backed data) and acc (when computed),
        plus each (k, λ)'s ``coverage``, the share of targets carried by at least one of the k neighbours."""
        out: dict[Any, dict[str, float]] = {"base": self._summary(self.base, prefix)}
        for (k, lam), sums in self.mixed.items():
            out[(k, lam)] = self._summary(sums, prefix)
            out[(k, lam)][f"{prefix}/coverage"] = float(self.coverage[k] / sums["count"].clamp_min(1))
        return out

    def _summary(self, sums: dict[str, Tensor], prefix: str) -> dict[str, float]:
        got = {key: float(v) for key, v in summarize(sums, "lm", prefix).items()}
        if not self.accuracy:
            got.pop(f"{prefix}/acc")
        return got


def score(
    ckpt: str | Path,
    store_dir: str | Path,
    split: str = "test",
    *,
    ks: Sequence[int] = (1024,),
    lambdas: Sequence[float] = (0.25,),
    temperature: float = 1.0,
    index: str = "exact",
    batch_size: int | None = None,
    limit: int | None = None,
    device: str = "cpu",
    accuracy: bool = True,
) -> tuple[KnnScorer, dict[str, Any]]:
    """Score ``split`` of the checkpoint's data with the base model and kNN-LM over ``store_dir`` for
    every (k, λ); returns the scorer (``.metrics(split)``) and a description of the run."""
    for k, lam in itertools.product(ks, lambdas):
        check_knn_options(k, lam, temperature)
    read_manifest(Path(store_dir))  # a wrong directory fails before the model loads
    model, meta, identity = load_checked(ckpt, device)
    store = Datastore.open(store_dir, index=index, device=device, checkpoint=identity)
    info = meta["data_info"]
    token_bytes = torch.tensor(info["token_bytes"]) if info.get("token_bytes") else None
    same = split == store.manifest["split"]
    scorer = KnnScorer(store, ks, lambdas, temperature, exclude_self=same, token_bytes=token_bytes, accuracy=accuracy)
    n = 0
    for batch, logits, keys in batches(model, meta, split, batch_size, limit, device):
        scorer.add(batch, logits, keys)
        n += 1
    about = {"batches": n, "store_size": store.size, "exclude_self": same, "index": index}
    return scorer, about
