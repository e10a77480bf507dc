"""Target adapters: one small interface (`engine.targets.base`), one module per kind of
system Airlock writes to (PostgreSQL rows, HTTP/ETag services, git files).

Framework-light on purpose: no Django, no app imports. The caller (the barrier, the executor,
undo and the plan engine, once wired) hands each call its fence and idempotency key and
records the outcome; an adapter only talks to its target.
"""
