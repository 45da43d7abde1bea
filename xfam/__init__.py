"""xfam: a config-driven training framework for the Transformer family."""

__version__ = "0.1.0"
