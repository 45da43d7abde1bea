"""A component's YAML equals its signature: ``configs/<slot>/<name>.yaml`` in xfam's config folder
(``xfam.core.config_dir.CONFIG_DIR``) holds ``name`` and every user-settable parameter with the constructor's
default, in the signature's order, since the signature is the one place defaults live. A component without a YAML
there (a plugin's) is skipped: xfam generates its Hydra option from the signature, so there is nothing to keep equal."""

from __future__ import annotations

import pytest
import yaml

from xfam.core.registry import defaults_of
from xfam.testing._suite import each, registry_of


def yaml_cases(comps) -> list:
    return [pytest.param(comps.slot, name, id=name) for name in comps.names]


@each(("slot", "name"), yaml_cases)
def test_yaml_equals_signature_defaults(slot, name):
    from xfam.core.config_dir import CONFIG_DIR

    path = CONFIG_DIR / slot / f"{name}.yaml"
    if not path.exists():
        pytest.skip(f"{slot}={name} has no {path.name} in xfam's config folder: its option comes from its signature")
    cfg = yaml.safe_load(path.read_text())
    defaults = {k: list(v) if isinstance(v, tuple) else v for k, v in defaults_of(registry_of(slot).get(name)).items()}
    assert cfg == {"name": name, **defaults}, f"{path} must mirror the signature's defaults"
    assert list(cfg) == ["name", *defaults], f"{path} must list the parameters in the signature's order"
