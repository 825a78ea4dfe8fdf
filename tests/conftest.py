"""Shared test set-up: 8 forced CPU devices, so shard_map and pmap run on one machine."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
