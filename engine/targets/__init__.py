"""Target adapters: one small interface (`engine.targets.base`), one module per kind of
system Airlock writes to (PostgreSQL rows, HTTP/ETag services, git files). Airlock's own
store implements the same interface in engine/core/managed_target.py: it runs inside the
caller's database transaction, so it needs the ORM, which this package never imports.

Framework-light on purpose: no Django, no app imports. The caller (the barrier, the executor,
undo and the plan engine) hands each call its fence and idempotency key and records the
outcome; an adapter only talks to its target.
"""
