"""xfam: a config-driven training framework for the Transformer family.

Public Python API (imported lazily, so ``import xfam`` stays cheap):

    xfam.build_model(config, data_info)   # a model from a plain config or validate's RunConfig (no Hydra)
    xfam.build_data(config)               # the data source of config["data"]
    xfam.load_model(path)                 # (model, metadata) from a checkpoint (no Lightning, no Hydra)
    xfam.validate(config)                 # a frozen RunConfig; every problem of a config as one ConfigError
    xfam.train(config, run_dir)           # one training run, as train.py does it
"""

from typing import Any

__version__ = "0.2.0"  # (pyproject.toml reads it; CHANGELOG.md)

_API = {
    "build_model": "xfam.model.build",
    "build_data": "xfam.model.build",
    "load_model": "xfam.model.checkpoint",
    "validate": "xfam.config",
    "train": "xfam.training.runner",
    "ConfigError": "xfam.core.errors",
}
__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'xfam' has no attribute {name!r}")
