"""Test setup: 8 simulated CPU devices, so data-parallel code runs as on a real mesh."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
