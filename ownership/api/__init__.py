"""API of the ownership app: resources (reads and conditional writes), conflicts,
the catalog (conflict classes, resource kinds)."""

from __future__ import annotations

from ninja import Router

from ownership.api import catalog, conflicts, resources

router = Router()
for part in (resources, conflicts, catalog):
    router.add_router("", part.router)
