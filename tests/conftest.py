"""Shared pytest set-up. Keep this file generic; test-specific fixtures belong in the test modules.

Helpers shared by several test modules live in ``tests/harness.py`` (importable as ``harness`` because
pytest puts this folder on ``sys.path``).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# Property tests: no per-example deadline (CI machines are slow and shared). Under CI the examples are
# derandomized, so a red run is reproducible and a green one is not luck; locally they vary, so the
# search keeps exploring. Select explicitly with HYPOTHESIS_PROFILE=dev|ci.
settings.register_profile("dev", deadline=None)
settings.register_profile(
    "ci", deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
