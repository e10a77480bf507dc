"""The bare baselines, served by gunicorn sync only (bench.settings):

- `bare_token_view` for `poll_vs_bare`: a bearer run token found by its prefix and checked by
  SHA-256 in constant time, then one row by primary key;
- `bare_insert_view` for `proposal_vs_bare_insert` (bench.proposals): the same token check,
  then one INSERT into the bench's own table (bench_bare_proposal, created by the bench, never by a
  product migration) in one transaction, answered 202 with a small JSON body.
"""

from __future__ import annotations

import hashlib
import hmac
import uuid

from django.db import connection, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from approvals.models import Action, Run

PREFIX_LENGTH = 12  # the product's lookup prefix: "rt_" + 9 characters
BARE_PROPOSALS_DDL = (
    "CREATE TABLE IF NOT EXISTS bench_bare_proposal (id bigserial PRIMARY KEY, kind text NOT NULL, "
    "name text NOT NULL, idempotency_key text NOT NULL, patch jsonb NOT NULL, "
    "created_at timestamptz NOT NULL DEFAULT now())"
)
_INSERT = (
    "INSERT INTO bench_bare_proposal (kind, name, idempotency_key, patch) "
    "VALUES (%s, %s, %s, %s::jsonb) RETURNING id"
)


def _token_ok(request: HttpRequest) -> bool:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    digest = hashlib.sha256(token.encode()).hexdigest()
    hashes = Run.objects.filter(token_prefix=token[:PREFIX_LENGTH]).values_list(
        "token_hash", flat=True
    )
    return scheme.lower() == "bearer" and any(hmac.compare_digest(h, digest) for h in hashes)


def bare_token_view(request: HttpRequest, action_id: uuid.UUID) -> HttpResponse:
    if not _token_ok(request):
        return JsonResponse({"code": "unauthenticated"}, status=401)
    row = Action.objects.filter(pk=action_id).values("id", "status", "revision").first()
    if row is None:
        return JsonResponse({"code": "not_found"}, status=404)
    return JsonResponse({"id": str(row["id"]), "status": row["status"], "rev": row["revision"]})


@csrf_exempt  # a bearer-token API, as the product's own (ninja's routes are not CSRF-checked)
def bare_insert_view(request: HttpRequest, kind: str, name: str) -> HttpResponse:
    """Token check and one INSERT in one transaction; 202 with the row's id."""
    if request.method != "PATCH":
        return JsonResponse({"code": "method_not_allowed"}, status=405)
    key = request.headers.get("Idempotency-Key", "")
    with transaction.atomic():
        if not _token_ok(request):
            return JsonResponse({"code": "unauthenticated"}, status=401)
        with connection.cursor() as cursor:
            cursor.execute(_INSERT, [kind, name, key, request.body.decode() or "{}"])
            row = cursor.fetchone()
    assert row is not None
    return JsonResponse({"id": row[0], "status": "queued"}, status=202)
