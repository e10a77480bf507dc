"""Conditional-request headers (RFC 9110 section 13): entity tags, If-Match on a write
(exactly one strong tag) and If-None-Match on a read. Pure parsing; the errors map to
400 `bad_header` / `if_match_invalid` and 428 `precondition_required`."""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine.core.errors import DomainError


class HeaderSyntaxError(DomainError):
    code = "bad_header"


class PreconditionRequired(DomainError):
    code = "precondition_required"


# --- Entity tags (RFC 9110 section 8.8.3) ----------------------------------

_ETAG = re.compile(r'(W/)?"([\x21\x23-\x7e]*)"')


@dataclass(frozen=True)
class EntityTag:
    weak: bool
    opaque: str

    def __str__(self) -> str:
        return f'{"W/" if self.weak else ""}"{self.opaque}"'


@dataclass(frozen=True)
class TagCondition:
    """A parsed If-Match / If-None-Match: `*` or a list of entity tags."""

    any: bool
    tags: tuple[EntityTag, ...]

    def strong_match(self, etag: str | None) -> bool:
        """Strong comparison: weak tags never match (If-Match)."""
        if etag is None:
            return False
        if self.any:
            return True
        return any(not tag.weak and str(tag) == etag for tag in self.tags)

    def weak_match(self, etag: str | None) -> bool:
        """Weak comparison (If-None-Match on reads)."""
        if etag is None:
            return False
        if self.any:
            return True
        bare = etag.removeprefix("W/")
        return any(f'"{tag.opaque}"' == bare for tag in self.tags)

    def describe(self) -> str:
        return "*" if self.any else ", ".join(str(tag) for tag in self.tags)


def parse_tag_condition(raw: str | None, *, header: str) -> TagCondition | None:
    """Parse `*` or `#entity-tag`. None when absent. Raises HeaderSyntaxError (400)."""
    if raw is None:
        return None
    value = raw.strip()
    if value == "*":
        return TagCondition(any=True, tags=())
    tags: list[EntityTag] = []
    position = 0
    saw_star = False
    while position < len(value):
        # Skip OWS and empty list elements (RFC 9110 section 5.6.1).
        while position < len(value) and value[position] in " \t,":
            position += 1
        if position >= len(value):
            break
        if value[position] == "*":
            saw_star = True
            position += 1
        else:
            match = _ETAG.match(value, position)
            if match is None:
                raise HeaderSyntaxError(
                    f"{header} is not '*' or a list of entity tags like \"41\".",
                    extra={"header": header},
                )
            tags.append(EntityTag(weak=bool(match.group(1)), opaque=match.group(2)))
            position = match.end()
        while position < len(value) and value[position] in " \t":
            position += 1
        if position < len(value) and value[position] != ",":
            raise HeaderSyntaxError(
                f"{header} entity tags must be separated by commas.", extra={"header": header}
            )
    if saw_star:
        raise HeaderSyntaxError(
            f"{header}: '*' cannot be combined with entity tags.", extra={"header": header}
        )
    if not tags:
        raise HeaderSyntaxError(f"{header} is empty.", extra={"header": header})
    return TagCondition(any=False, tags=tuple(tags))


class IfMatchInvalid(DomainError):
    code = "if_match_invalid"


def parse_write_if_match(raw: str | None) -> TagCondition | None:
    """If-Match on a write: exactly one strong entity tag, the version the agent read.

    RFC 9110 also allows `*` and lists, but either would let an agent that read
    version 41 overwrite 42 without having seen it. Raises PreconditionRequired
    (428) for `*`, IfMatchInvalid (400) for a list or a weak tag, and
    HeaderSyntaxError (400) for anything that is not an entity-tag list.
    """
    condition = parse_tag_condition(raw, header="If-Match")
    if condition is None:
        return None
    if condition.any:
        raise PreconditionRequired(
            'If-Match: * does not name a version: send the ETag you read, e.g. If-Match: "41".',
            extra={"header": "If-Match"},
        )
    if len(condition.tags) != 1:
        raise IfMatchInvalid(
            "If-Match must name exactly one ETag, the version you read "
            f"(got {len(condition.tags)}).",
            extra={"header": "If-Match"},
        )
    if condition.tags[0].weak:
        raise IfMatchInvalid(
            "If-Match must be a strong ETag (no W/ prefix): a weak tag never matches a write.",
            extra={"header": "If-Match"},
        )
    return condition


def read_condition(raw: str | None) -> TagCondition | None:
    """If-None-Match on a read: a malformed value is ignored (no condition)."""
    try:
        return parse_tag_condition(raw, header="If-None-Match")
    except HeaderSyntaxError:
        return None
