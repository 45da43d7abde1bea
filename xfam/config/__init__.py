"""Validation of a whole composed configuration, before any tensor is allocated or file written.

``validate(cfg)`` collects every problem in every section (unknown names and keys, wrong types,
impossible values, incompatible slot combinations) and raises one ``ConfigError`` listing them
all, each with the fix; a valid config comes back as a frozen ``RunConfig`` (the model spec, each
layer's slot configs, the compatibility selection, the stream layout and the typed sections), which
the runner, the Lightning module and ``build_model`` read. It reads signatures and class attributes
only: no data, no model.

Modules: ``validation`` (the whole config), ``run`` (``RunConfig``), ``slots`` (the slot sections and the
stream layout), ``metrics`` (the metrics a run reports), ``trainer`` (Lightning's Trainer arguments and the
machine), ``trainer_args`` (their values), ``specs`` (the other plain sections).
"""

from xfam.config import trainer_args
from xfam.config.metrics import AUX_METRIC_SLOTS, final_metrics
from xfam.config.run import RunConfig
from xfam.config.slots import SLOTS, _slot_problems, resolve_streams, streams_of
from xfam.config.trainer import (
    TRAINER_OWNED,
    XFAM_TRAINER,
    XFAM_TRAINER_INTS,
    check_machine,
    check_trainer,
    lightning_trainer_args,
)
from xfam.config.validation import SECTIONS, validate

__all__ = [
    "AUX_METRIC_SLOTS",
    "SECTIONS",
    "SLOTS",
    "TRAINER_OWNED",
    "XFAM_TRAINER",
    "XFAM_TRAINER_INTS",
    "RunConfig",
    "_slot_problems",
    "check_machine",
    "check_trainer",
    "final_metrics",
    "lightning_trainer_args",
    "resolve_streams",
    "streams_of",
    "trainer_args",
    "validate",
]
