"""Kill-switch check used before any write.

Scopes: `*` (everything), `kind/prefix*` (a namespace) or an exact `kind/name`.
The write barrier calls `engaged_switch_for` inside its transaction, so a write
whose check runs after an engage has committed is refused.
"""

from __future__ import annotations

from console.models import KillSwitch


def engaged_switch_for(resource_identifier: str) -> KillSwitch | None:
    """The engaged switch covering `resource_identifier`, or None.

    When several cover it, the broadest wins (`*`, then the shortest prefix),
    so the reason shown is the one an operator must release last.
    """
    covering = [
        switch
        for switch in KillSwitch.objects.filter(engaged=True).only("id", "scope", "reason")
        if switch.covers(resource_identifier)
    ]
    if not covering:
        return None
    return min(covering, key=lambda switch: (switch.scope != "*", len(switch.scope)))


def any_engaged() -> bool:
    return KillSwitch.objects.filter(engaged=True).exists()
