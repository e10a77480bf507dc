from __future__ import annotations

import gc
import os

import django
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler
from django.urls import get_resolver

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
# Settings are loaded below, while this module is being imported: that is how they know this
# is a web process (SERVES_ASGI), whose database connections are pooled by default (each
# request's sync work runs in a thread of its own; see the Database section of settings).
django.setup(set_prefix=False)

from console import tracing  # noqa: E402

# OpenTelemetry when OTEL_EXPORTER_OTLP_ENDPOINT is set: before the handler loads the
# middleware, which Django's instrumentation adds to (console/tracing.py).
tracing.setup_from_env("airlock-web", django=True)

from approvals.api.fastpoll import PollFront  # noqa: E402  # reason: needs django.setup()
from console.middleware import AirlockASGIHandler  # noqa: E402  # reason: needs django.setup()

# /static/ is answered by Django's static files handler (found through the finders, no
# collectstatic step); everything else goes to Django. Behind a reverse proxy that serves
# /static/ itself, this wrapper is never reached for those paths.
django_application = ASGIStaticFilesHandler(AirlockASGIHandler())
# An agent's reads (action and run polls, resource reads) are answered in front of Django
# when they can be (approvals/api/fastpoll.py and its route table); every other request,
# and any doubt, goes to Django.
application = PollFront(django_application)

# The modules, URL patterns and API schemas loaded by now live as long as the process: take
# them out of the garbage collector's sight (gc.freeze), so that a full collection walks only
# what requests made since. Without this, a full collection under 2,000 held polls took
# 120-150 ms, and every request and wake-up of the process waited behind it.
get_resolver().url_patterns  # noqa: B018  # reason: imports every view and API module now
gc.freeze()
