"""What a peer's rounds speak, in one tag. Members whose tags differ would misread each other: a
defended member checks sizes an undefended one never sends (and bans it as malformed), an audited
member asks its auditor for a verdict an unaudited one never gives (and leaves it out as a
staller), and a later version may change the wire. So each tag averages only with its own (the
averager's prefix, which names its matchmaking keys and its handlers), and a peer that sees a
live peer of another tag says so once instead of waiting for it in silence."""

from __future__ import annotations

PROTOCOL_VERSION = 4
"""Raised whenever a change makes an older peer misread a newer one's rounds (3: members declare
their start lag, and one that declares none gets the cap of the group's, exact.start_timeouts;
4: members declare whom they hold on probation, and a member most of the group declares is left
out of every span's average, probation.py: an older auditor would replay it averaged in, and ban
the honest reducer)."""


def protocol_tag(defend: bool, audit: bool) -> str:
    mode = ("defended-audited" if audit else "defended") if defend else "undefended"
    return f"v{PROTOCOL_VERSION}-{mode}"


def averaging_prefix(swarm: str, tag: str) -> str:
    """The averager's prefix: its matchmaking keys and the names of its handlers."""
    return f"{swarm}_avg_{tag}"


def describe(tag: str) -> str:
    """A tag as a user reads it, for the warning (an old peer publishes none)."""
    return tag or "an older version without a protocol tag"
