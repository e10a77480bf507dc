"""The execution core: fenced lock, write barrier, undo, kill-switch check, target adapters.

Framework-light: it uses the ORM and Redis, never HTTP requests, templates or HTMX.
"""
