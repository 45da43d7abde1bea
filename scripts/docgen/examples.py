"""One command line that trains with each component, for its reference section.

The rule, in order: a component that needs more than a selection has its command here (``SETUP``: memory=spalm
needs a datastore of a trained model); a component that an experiment config selects (``override /attention:
local2d`` in configs/experiment/image_gen.yaml) trains in that experiment, the setting it was written for; an
attention that cannot be causal trains a classifier (``BIDIRECTIONAL``); any other component is selected on the
default configuration (a causal byte-level LM on the embedded corpus). tests/unit/test_generate_docs.py runs the
pre-launch check (``xfam.training.precheck``) on every command.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

from xfam.training.run_names import CONFIG_DIR

#: An experiment whose model is a bidirectional classifier (for attention that cannot be causal).
BIDIRECTIONAL = "experiment=listops"
#: Slots whose experiments are about the component they select (a pos or memory an experiment picks is incidental).
BY_EXPERIMENT = ("attention", "exit", "data")
#: The configuration train.yaml selects (its components need no experiment).
DEFAULTS = {"attention": "vanilla", "pos": "rope", "memory": "none", "exit": "none", "data": "text"}

KNNLM_RUN = "runs/knnlm/experiment:knnlm"


@dataclasses.dataclass(frozen=True)
class Example:
    """``command`` trains with the component; ``setup`` are the commands it needs run first (shown, not checked:
    the test stands in for their output, e.g. a datastore)."""

    command: str
    setup: tuple[str, ...] = ()
    note: str = ""


SETUP: dict[tuple[str, str], Example] = {
    ("memory", "spalm"): Example(
        command=f"python train.py memory=spalm pos=xl memory.store={KNNLM_RUN}/knnlm/last_train",
        setup=(
            "python train.py experiment=knnlm  # a language model to build the datastore with",
            f"xfam knnlm build ckpt={KNNLM_RUN}/checkpoints/last.ckpt split=train  # its datastore",
        ),
        note="SPALM's long-term memory is a datastore of a trained language model (`xfam knnlm build`).",
    ),
}


@functools.lru_cache(maxsize=1)
def experiment_choices() -> dict[str, dict[str, str]]:
    """``{experiment: {group: option}}``: what each experiment config selects (its ``override /group: option``)."""
    out = {}
    for path in sorted((Path(CONFIG_DIR) / "experiment").glob("*.yaml")):
        found = re.findall(r"^\s*-\s*override\s+/(\w+)\s*:\s*(\w+)\s*$", path.read_text(), re.M)
        out[path.stem] = dict(found)
    return out


def experiments_with(slot: str, name: str) -> list[str]:
    """The experiments that select ``slot=name``, those named after it first (data=docstrings: seq2seq_docstrings)."""
    found = [e for e, choices in experiment_choices().items() if choices.get(slot) == name]
    return sorted(found, key=lambda e: name not in e)


def example(slot: str, cls: type) -> Example:
    name = cls.registry_name
    if (slot, name) in SETUP:
        return SETUP[slot, name]
    words = ["python train.py"]
    experiments = experiments_with(slot, name) if slot in BY_EXPERIMENT and DEFAULTS[slot] != name else []
    if experiments:
        words.append(f"experiment={experiments[0]}")
    elif slot == "attention" and not cls.causal:
        words.append(BIDIRECTIONAL)
    words.append(f"{slot}={name}")
    return Example(" ".join(words))
