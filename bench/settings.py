"""The bare baseline's settings: the product's settings, with only the baseline URL routed."""

from __future__ import annotations

from console.settings import *  # noqa: F403

ROOT_URLCONF = "bench.urls"
