"""kNN-LM (Khandelwal et al., 2020, "Generalization through Memorization: Nearest Neighbor Language
Models", arXiv:1911.00172): an evaluation-time add-on over any trained xfam language model.

A datastore holds, for every target position of a text collection, the key ``f(c_i)`` (the input of
the final layer's FFN after its norm) and the value ``w_i`` (the next token); at evaluation the model's
next-token distribution is interpolated with a distribution over the values of the k nearest keys:
``p = λ p_kNN + (1 - λ) p_LM``, ``p_kNN(y) ∝ Σ_{neighbours with value y} exp(-d / T)``.

    xfam knnlm build ckpt=PATH split=train          # xfam.eval.knnlm.build_datastore
    xfam knnlm eval ckpt=PATH store=DIR split=test  # xfam.eval.knnlm.score

Modules: ``keys`` (capturing the key with a forward hook; which models qualify), ``datastore`` (the
on-disk store, its manifest and search), ``search`` (exact torch and FAISS indexes), ``interpolate``
(the kNN distribution and the log-space interpolation), ``run`` (the build and scoring loops).
"""

from xfam.knnlm.datastore import Datastore, DatastoreWriter, Neighbours, checkpoint_identity
from xfam.knnlm.interpolate import (
    KnnMixer,
    interpolate,
    interpolated_log_probs,
    knn_log_probs,
    knn_target_log_probs,
)
from xfam.knnlm.keys import KeyCapture, check_supported

__all__ = [
    "Datastore",
    "DatastoreWriter",
    "KeyCapture",
    "KnnMixer",
    "Neighbours",
    "check_supported",
    "checkpoint_identity",
    "interpolate",
    "interpolated_log_probs",
    "knn_log_probs",
    "knn_target_log_probs",
]
