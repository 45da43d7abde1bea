"""Evaluation tools (no Lightning): inference reports, calibration, memory carry, metrics, generation,
kNN-LM and length extrapolation."""
