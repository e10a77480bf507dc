from __future__ import annotations

import os

import django
from django.conf import settings
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler
from django.core.handlers.asgi import ASGIHandler

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
# Settings are loaded below, while this module is being imported: that is how they know this
# is a web process (SERVES_ASGI), whose database connections are pooled by default (each
# request's sync work runs in a thread of its own; see the Database section of settings).
django.setup(set_prefix=False)

from console.middleware import asgi_middleware  # noqa: E402  # reason: needs django.setup()


class AirlockASGIHandler(ASGIHandler):
    """Django's ASGI handler, loading console.middleware's thread-free subclasses of the
    middlewares settings.MIDDLEWARE names (which keeps Django's names for its checks)."""

    def load_middleware(self, is_async: bool = False) -> None:
        declared = settings.MIDDLEWARE
        settings.MIDDLEWARE = asgi_middleware(declared)
        try:
            super().load_middleware(is_async)
        finally:
            settings.MIDDLEWARE = declared


# /static/ is answered by Django's static files handler (found through the finders, no
# collectstatic step); everything else goes to Django. Behind a reverse proxy that serves
# /static/ itself, this wrapper is never reached for those paths.
application = ASGIStaticFilesHandler(AirlockASGIHandler())
