"""The write barrier. Owner: core helper. Interface contract (see issue 2):

open_operation(*, action_id, fence, worker: str, lease_seconds: int, undo_of_id=None) -> Operation
    Creates the Operation row (status pending) and moves the action to `executing`.

apply_action(*, action_id, operation_id, fence, actor: Actor) -> WriteOutcome
    ONE transaction: kill-switch re-check, conditional UPDATE (or INSERT for a create)
    `... WHERE id = :id AND version = :observed AND last_fence < :fence`, the new
    ResourceVersion row, Operation -> done (undo deadline from the kind/class window),
    Action -> applied (revision + 1), audit event `write.applied`.
    Zero rows: re-read to tell stale version from stale fence, record the refusal
    (Operation -> failed with outcome, audit `write.refused`), change nothing else,
    and return WriteOutcome(applied=False, refusal=...). The caller (the engine)
    routes a stale version to a conflict.
"""
