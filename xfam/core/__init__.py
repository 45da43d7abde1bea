"""Contracts every slot shares, the registry, errors, logging and schedules: imports nothing of xfam."""
