"""The baseline for `poll_vs_bare`: a bearer run token found by its prefix and checked by
SHA-256 in constant time, then one row by primary key. Served by gunicorn sync only."""

from __future__ import annotations

import hashlib
import hmac
import uuid

from django.http import HttpRequest, HttpResponse, JsonResponse

from approvals.models import Action, Run

PREFIX_LENGTH = 12  # the product's lookup prefix: "rt_" + 9 characters


def bare_token_view(request: HttpRequest, action_id: uuid.UUID) -> HttpResponse:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    digest = hashlib.sha256(token.encode()).hexdigest()
    hashes = Run.objects.filter(token_prefix=token[:PREFIX_LENGTH]).values_list(
        "token_hash", flat=True
    )
    if scheme.lower() != "bearer" or not any(hmac.compare_digest(h, digest) for h in hashes):
        return JsonResponse({"code": "unauthenticated"}, status=401)
    row = Action.objects.filter(pk=action_id).values("id", "status", "revision").first()
    if row is None:
        return JsonResponse({"code": "not_found"}, status=404)
    return JsonResponse({"id": str(row["id"]), "status": row["status"], "rev": row["revision"]})
