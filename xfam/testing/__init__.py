"""The contract tests of xfam's slots, as a kit for anyone's component: the tests xfam's own pass.

One line per component, in a test file of your package:

    # mypkg/tests/test_contracts.py
    from xfam.testing import contract_tests

    TestGatedAttention = contract_tests("attention", "gated")   # a registered name ...
    TestMyBias = contract_tests("pos", MyBias)                  # ... or the registered class itself

``contract_tests(slot, component, *, params=None, parts=None, xfail=None)`` returns a pytest class (collected
because you bind it to a ``Test*`` name) whose tests are exactly the contracts xfam's own components of that
slot run, parametrised over what your component declares (its mask directions, backends, ``exact_params``):

    attention  attention      shapes, dtypes and gradients; bf16/fp16; no causal leak; determinism; parity with
                              softmax attention on every mask form in the degenerate limit ``exact_params``, with a
                              score bias and a score modifier where it takes them; grouped-query; decode equal to
                              the full computation; right padding
               decode         a model's cached decoding equal to recomputing the prefix
               aux_losses     ``aux_losses`` summed over layers into the output, with gradients (``aux_loss`` only)
               backends       every ``backend`` equal to the reference one in a model: outputs and gradients
               matrix         with every xfam ``pos``: validated, then built and trained, or refused with a reason
               yaml_defaults  a YAML in xfam's config folder equal to the signature (skipped: no YAML)
    pos        pos            shapes and gradients; no causal leak; cached decoding, also left-padded; determinism;
                              a bidirectional classifier; SDPA equal to the reference path; relative means
                              shift-invariant; + backends, matrix (with every xfam attention), yaml_defaults
    memory     memory         state in, state out; detached between segments; gradients and aux losses; the
                              state changes the next segment; a cache of past layer inputs (``mem_len``, no
                              ``augments_attention``) equal to one full run; + yaml_defaults
    exit       exit           shapes, depth, aux losses and gradients (lm and classify); no causal leak; cached
                              decoding; determinism; an early-exit policy under ``full_depth()`` is the plain
                              stack; + yaml_defaults

Options:
    params  config set on top of the component's defaults (an attention's on top of ``exact_params``), e.g.
            ``{"heads_per_group": 2}``; a ``backend`` here pins one backend.
    parts   only these parts of the slot (the names above), e.g. to split a slow part into its own class.
    xfail   contracts the component is known to fail, by design, with the reason: ``{"test_name": "why"}`` or
            ``{"test_name[id pattern]": "why"}`` (``*`` is any text in the test id, e.g.
            ``"test_right_padding_leaves_the_real_tokens_unchanged[*-bidir]"``); strict: a pass fails the run, and
            a key that matches no test is an error.

A contract that does not apply is left out of the class (no causal-leak test for a bidirectional-only mechanism);
a case xfam itself refuses (the component's ``refusals``), a memory that ``needs_store``, a Triton backend off
CUDA and the YAML check of a component without a YAML are skipped with the reason. A mechanism that approximates
softmax attention declares ``exact_params(seq_len)``; ``backends`` lists the fast paths first and the reference
last (a ``triton`` kernel aside). Each test starts from ``torch.manual_seed(0)``. A component is
registered before the call: import its module, or install the package whose ``xfam.components`` entry point
does. The contract functions live in ``xfam.testing.<part>`` (plain pytest functions; xfam's own
``tests/contracts`` build their classes with the same call), the doubles they use in ``xfam.testing.doubles``.
Importing the kit registers nothing; it needs pytest (``pip install xfam[testing]``). docs/extending.md has more.
"""

from xfam.testing._suite import SUITES, contract_tests
from xfam.testing.doubles import own_components

__all__ = ["contract_tests", "own_components", "SUITES"]
