from __future__ import annotations

import pytest

from tests.fixtures.console import People, World, client_for

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    "path",
    ["/", "/approvals/", "/conflicts/", "/conflicts/?scope=all", "/runs/", "/resources/",
     "/catalog/", "/audit/", "/tokens/", "/audit/verify/", "/dashboard/counts/",
     "/kill-switch/banner/"],
)
def test_every_main_page_renders_for_an_admin(people: People, world: World, path: str) -> None:
    response = client_for(people.admin).get(path)
    assert response.status_code == 200, response.content[:3000]


def test_object_pages_render(people: People, world: World) -> None:
    client = client_for(people.admin)
    for path in [
        f"/runs/{world.run.id}/",
        f"/actions/{world.action.id}/",
        f"/conflicts/{world.conflict.id}/",
        f"/resources/{world.resource.identifier}/",
    ]:
        response = client.get(path)
        assert response.status_code == 200, (path, response.content[:3000])
