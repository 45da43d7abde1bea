"""Training: the runner, the Hydra glue and the Lightning module, trainer and callbacks."""
