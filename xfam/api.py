"""Everything a component author needs, in one import.

A new attention mechanism, positional encoding, memory, exit policy or data source subclasses its
slot's base class, registers itself under a name, and speaks only the contract types below (masks,
score biases, decode and memory state, the layer stack an exit policy drives); the model builder
injects the structural sizes (``dim``, ``heads``, ``max_len``, ...) into its keyword-only constructor.
See docs/tutorials/add-a-component.md (a worked example) and docs/architecture.md.

    from xfam.api import ATTENTION, AttentionMechanism, AttnMask

    @ATTENTION.register("my_attention")
    class MyAttention(AttentionMechanism):
        ...
"""

from xfam.attention import ATTENTION, AttentionMechanism
from xfam.attention.vanilla import reference_attention
from xfam.core.bias import ScoreBias, ScoreModifier, additive_mask
from xfam.core.context import LayerContext
from xfam.core.errors import ConfigError
from xfam.core.logs import log_once
from xfam.core.mask import SHARED, AttnMask
from xfam.core.registry import Component, NonNegative, Positive, Probability, Range, Registry
from xfam.core.sinusoid import TimestepSignal, sinusoid_table
from xfam.core.stack import LayerStack
from xfam.core.state import DecodeState, LayerView, MemoryState, expand_kv
from xfam.data import DATA, DataSource
from xfam.exit import EXIT, EarlyExitPolicy, ExitOutput, ExitPolicy
from xfam.memory import MEMORY, Memory
from xfam.pos import KINDS, POS, PositionalEncoding

__all__ = [
    # slots: base classes and their registries
    "ATTENTION",
    "AttentionMechanism",
    "POS",
    "KINDS",
    "PositionalEncoding",
    "MEMORY",
    "Memory",
    "EXIT",
    "ExitPolicy",
    "EarlyExitPolicy",
    "ExitOutput",
    "DATA",
    "DataSource",
    # contracts between slots
    "AttnMask",
    "SHARED",
    "ScoreBias",
    "ScoreModifier",
    "additive_mask",
    "DecodeState",
    "MemoryState",
    "LayerView",
    "LayerContext",
    "LayerStack",
    "expand_kv",
    # explicit-score softmax attention, the ground truth a mechanism is compared against (xfam.testing does)
    "reference_attention",
    "TimestepSignal",
    "sinusoid_table",
    # registry, parameter constraints, errors, logging
    "Registry",
    "Component",
    "Range",
    "Positive",
    "NonNegative",
    "Probability",
    "ConfigError",
    "log_once",
]
