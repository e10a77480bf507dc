"""The execution engine (issue 39 §2 "A home for the core"): the core in `engine.core` —
fenced lock, fence, write barrier, operations, undo, kill-switch check — and the target
adapters in `engine.targets`, one module per real system. `console/` keeps the project's
wiring and web plumbing."""
