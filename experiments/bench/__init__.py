"""Timings and sizes measured without a training run."""
