"""Kill-switch check used before any write. Owner: core helper.

engaged_switch_for(resource_identifier: str) -> KillSwitch | None
"""
