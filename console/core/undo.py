"""Undo through the same barrier. Owner: core helper. Interface contract:

apply_undo(*, operation_id, undo_operation_id, fence, actor: Actor) -> UndoOutcome
    Restores the document from before `operation_id` only while the resource is
    still at the version that operation produced and inside its undo deadline.
    One undo per operation (Operation.undo_of is unique). Refusals:
    "window_expired", "resource_moved" (the caller opens a conflict), "already_undone".
"""
