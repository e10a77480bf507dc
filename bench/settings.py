"""The production settings plus one URL: the bare baseline view the poll path is compared to."""

from __future__ import annotations

from console.settings import *  # noqa: F403

ROOT_URLCONF = "bench.urls"
