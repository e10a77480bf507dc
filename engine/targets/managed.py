"""Airlock's own store (`ResourceKind.target = managed`) — NOT an adapter yet.

A managed kind's writes go through the write barrier (`engine/core/barrier.py`
`apply_action`: one conditional UPDATE of `ownership_resource` with the fence, the
`ResourceVersion`, the operation, the action and the audit event in one transaction) and
undo through `engine/core/undo.py`. The core now lives beside the adapters (issue 39 §2 "A
home for the core"); what remains is this module becoming the managed adapter — its version
the integer counter as text (`"41"`), holding the fence (`last_fence`), its write the
barrier's own statement — and the barrier, executor, undo, plan engine and conflict pages
calling only the adapter interface (docs/targets.md "What remains").
"""
