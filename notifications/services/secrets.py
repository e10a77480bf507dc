"""The subscriptions' secrets at rest: Fernet (cryptography) with a key from the
environment, and the webhook signing secrets (`whsec_…`, Standard Webhooks' form).

AIRLOCK_NOTIFY_KEY holds one or more Fernet keys, comma-separated: the first encrypts,
every one decrypts (rotate by putting a new key first). Unset, a key derived from
SECRET_KEY is used and `manage.py check` warns (notifications.W001).
"""

from __future__ import annotations

import base64
import hashlib
import secrets
from functools import lru_cache

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

WEBHOOK_SECRET_PREFIX = "whsec_"


def notify_key_is_derived() -> bool:
    """No AIRLOCK_NOTIFY_KEY: the secrets are encrypted with a key derived from SECRET_KEY."""
    return not str(settings.AIRLOCK_NOTIFY_KEY).strip()


@lru_cache(maxsize=4)
def _fernet(configured: str, secret_key: str) -> MultiFernet:
    keys = [key.strip() for key in configured.split(",") if key.strip()]
    if not keys:
        derived = hashlib.sha256(b"airlock-notify:" + secret_key.encode()).digest()
        keys = [base64.urlsafe_b64encode(derived).decode()]
    try:
        return MultiFernet([Fernet(key.encode()) for key in keys])
    except ValueError as exc:  # never echo the key itself
        raise ImproperlyConfigured(
            "AIRLOCK_NOTIFY_KEY must be Fernet keys (32 url-safe base64 bytes), comma-separated"
        ) from exc


def _current() -> MultiFernet:
    return _fernet(str(settings.AIRLOCK_NOTIFY_KEY), str(settings.SECRET_KEY))


def seal(plain: str) -> str:
    """`plain` encrypted for storage ("" stays "")."""
    if not plain:
        return ""
    return _current().encrypt(plain.encode()).decode()


def unseal(stored: str) -> str:
    """The stored secret in clear, for the one delivery that needs it. A secret sealed
    with a key no longer configured raises ImproperlyConfigured (without the secret)."""
    if not stored:
        return ""
    try:
        return _current().decrypt(stored.encode()).decode()
    except InvalidToken as exc:
        raise ImproperlyConfigured(
            "a subscription secret cannot be decrypted with AIRLOCK_NOTIFY_KEY "
            "(was the key, or SECRET_KEY, changed?)"
        ) from exc


def webhook_secret_new() -> str:
    """A new signing secret, `whsec_` + 32 random bytes in base64 (shown once)."""
    return WEBHOOK_SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()
