from __future__ import annotations

import os

import django
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
# Settings are loaded below, while this module is being imported: that is how they know this
# is a web process (SERVES_ASGI), whose database connections are pooled by default (each
# request's sync work runs in a thread of its own; see the Database section of settings).
django.setup(set_prefix=False)

from approvals.api.fastpoll import PollFront  # noqa: E402  # reason: needs django.setup()
from console.middleware import AirlockASGIHandler  # noqa: E402  # reason: needs django.setup()

# /static/ is answered by Django's static files handler (found through the finders, no
# collectstatic step); everything else goes to Django. Behind a reverse proxy that serves
# /static/ itself, this wrapper is never reached for those paths.
django_application = ASGIStaticFilesHandler(AirlockASGIHandler())
# An agent's short poll of an action is answered in front of Django when it can be
# (approvals/api/fastpoll.py); every other request, and any doubt, goes to Django.
application = PollFront(django_application)
