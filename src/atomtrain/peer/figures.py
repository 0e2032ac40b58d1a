"""What a peer writes about its rounds into each step's record (metrics.jsonl) and the figures its
status publishes: a landed round's bytes, times and group; the peers its averager rejected, left
out for a while, or read as opposing its update."""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Any

from atomtrain.peer.exclusion import for_its_updates

if TYPE_CHECKING:
    from atomtrain.peer.averaging import RoundResult
    from atomtrain.peer.runtime import PeerRuntime

log = logging.getLogger(__name__)


def record_landed(
    peer: PeerRuntime, result: RoundResult, record: dict[str, Any], round_s: float
) -> None:
    """What a round that landed moved and took, into this step's record and the figures
    the status publishes; the clock's period chosen from it."""
    assert peer.averager is not None
    sent0, received0 = peer._traffic_at_start
    sent, received = peer.averager.traffic.totals()
    if peer.wire is not None:  # everything since the last round: its share of the link
        # as the status thread last read it (every PUBLISH_EVERY_S, and as a round lands):
        # a netlink dump here would cost the training thread. So a round's figure may miss
        # its last moments, which the next round's then holds: the mean over rounds holds
        moved = sum(peer.wire.last_totals())
        peer.last_round_bytes = moved - peer._wire_at_last_round
        peer._wire_at_last_round = moved
        record["wire_bytes"] = moved
    else:  # the averager's messages only
        peer.last_round_bytes = (sent - sent0) + (received - received0)
    found = peer._group_found_at or time.perf_counter()
    peer.last_matchmaking_s = found - peer._looking_since
    record["averager_bytes"] = sent + received  # all rounds so far, failed ones too
    record["round_sent_bytes"] = sent - sent0
    record["round_received_bytes"] = received - received0
    record["matchmaking_s"] = peer.last_matchmaking_s
    peer.clock.choose_sync_every(result, round_s)
    if result.group_size > 1 and peer.first_contribution_s is None:
        peer.first_contribution_s = peer.last_sync - peer.started_at
        record["first_contribution_s"] = peer.first_contribution_s
        record["first_contribution_since_join_s"] = peer.last_sync - peer.joined_at
    record["group_size"] = result.group_size
    record["group"] = sorted(str(g.get("name", ""))[:64] for g in result.peers)
    peer.last_group_ids = result.peer_ids
    peer.averager.left_out_ids -= set(result.peer_ids)  # back in a round that landed
    record["round_s"] = round_s
    record["round_attempts"] = peer.averager.attempts
    record["round_bytes"] = peer.last_round_bytes
    record["averaging_memory_ratio"] = peer.averaging_memory_ratio()
    log.debug("round %d applied with %d peers", peer.round, result.group_size)


def note_rejections(peer: PeerRuntime, record: dict[str, Any]) -> None:
    """Peers this one's averager rejected (banned), left out for a while, or read as opposing its
    update since the last step: logged, and named in the step's record."""
    averager = peer.averager
    if averager is None:
        return
    # names from rounds' metadata, else from the live peers' signed statuses (one banned before
    # any round with it: forgers.py), no DHT call
    named = {s.peer_id: s.name for s in peer.presence.known_others}
    for other, why in averager.rejections():
        other = named.get(other, other)
        if other not in peer.rejected:
            peer.rejected[other] = why
            log.warning("rejected the contributions of %s (%s); ignoring it from now", other, why)
    if peer.rejected:
        record["rejected_peers"] = sorted(peer.rejected)
    for other, why in averager.stalls():  # excluded for a while, not banned
        other = named.get(other, other)
        log.warning("left %s out of rounds for a while: it %s", other, why)
        record.setdefault("stalled_peers", []).append(other)
        if for_its_updates(why):
            record.setdefault("left_out_for_updates", []).append(other)
    for name, peer_id, cosine, lean in averager.agreements():  # the update rules' readings
        log.debug("%s's update against this peer's: cosine %.3f, lean %.3f", name, cosine, lean)
        lean_kept = round(lean, 4) if math.isfinite(lean) else None
        record.setdefault("agreement", []).append([name, peer_id, round(cosine, 4), lean_kept])
