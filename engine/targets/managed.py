"""Airlock's own store (`ResourceKind.target = managed`) — NOT an adapter yet.

Today a managed kind's writes go through the existing write barrier
(`console/core/barrier.py` `apply_action`: one conditional UPDATE of `ownership_resource`
with the fence, the `ResourceVersion`, the operation, the action and the audit event in one
transaction) and undo through `console/core/undo.py`. Those modules are being changed by
other work this session, so they are not wrapped here: a wrapper now would be a second path
to the same rows. When the core moves to `engine/` (issue 39 §2 "A home for the core"),
this module becomes the managed adapter: its version is the integer counter as text
(`"41"`), it holds the fence (`last_fence`) and its write is the barrier's own statement.
"""
