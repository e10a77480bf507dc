from __future__ import annotations

import os

import django
from django.core.handlers.wsgi import WSGIHandler

from console import tracing

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
django.setup(set_prefix=False)
# OpenTelemetry when OTEL_EXPORTER_OTLP_ENDPOINT is set (console/tracing.py): before the
# handler loads the middleware, which Django's instrumentation adds to.
tracing.setup_from_env("airlock-web", django=True)
application = WSGIHandler()  # what get_wsgi_application() makes, after its django.setup()
