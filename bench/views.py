"""The baseline for `poll_vs_bare`: the same bearer-token lookup the API does, then one indexed
query, as a plain Django view with the same middleware stack. Served only by bench.settings."""

from __future__ import annotations

import uuid

from django.http import HttpRequest, HttpResponse, JsonResponse

from approvals.models import Action
from approvals.services.tokens import principal_for_token


def bare_token_view(request: HttpRequest, action_id: uuid.UUID) -> HttpResponse:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or principal_for_token(token.strip()) is None:
        return JsonResponse({"code": "unauthenticated"}, status=401)
    row = Action.objects.filter(pk=action_id).values("id", "status", "revision").first()
    if row is None:
        return JsonResponse({"code": "not_found"}, status=404)
    return JsonResponse({"id": str(row["id"]), "status": row["status"], "rev": row["revision"]})
