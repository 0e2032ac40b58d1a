"""One peer of the averaging-round test, run as its own process:

    python peer_round_harness.py INDEX WEIGHT WORKDIR [COMPRESSION [SKETCH]]

Peer 0 starts the DHT and writes its address to WORKDIR/addr; others join it. Each peer averages
its own known pseudo-gradient once and saves what came back to WORKDIR/out{INDEX}.pt. SKETCH:
where the peer says its synchronized parameters are (sync.py; members agree at 0).

With HARNESS_PEERS=N in the environment, each peer writes its peer ID to WORKDIR/id{INDEX}, waits
for N of them, and tells its averager those others (and those in HARNESS_ALSO_LIVE, comma
separated) are live, as a peer's presence does, and forms even a first try's group early
(assembly.py, `always`); HARNESS_MATCHMAKING_S sets the matchmaking time (3 s). The out file
also holds the round's wall time (`round_s`).

Each round harness peer gives its members START_TIMEOUT_S to open their streams (exact.py's
`start_timeout_s`, `peer.start_timeout_s` to a user), not the 1 s default: three harness peers
(each with its DHT, averager and p2pd processes) on a loaded 2-core CI machine once started
their all-reduces more than a second apart, and the others' ended early over the late one (a
stall, to them), which then held a partial round. These tests check what a round computes and
when its group forms; tests/test_security.py checks the start timeouts. atomtrain's INFO log
goes to stderr, which pytest shows for a test that fails.
"""

import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from hivemind import DHT

from atomtrain.peer.assembly import ALWAYS, RETRIES
from atomtrain.peer.averaging import ProbedAverager, RoundFailed
from atomtrain.peer.layout import cut_pieces

NUMEL = 5000
START_TIMEOUT_S = 5.0


def vectors(index: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(index))


def averaged_round(
    avg: ProbedAverager,
    delta: torch.Tensor,
    weight: float,
    name: str,
    rms_claim: float = 0.0,
    sketch: float = 0.0,
    give_up: Callable[[], bool] | None = None,
) -> dict:
    """One round with `delta` as this member's contribution; the flat average that came back.
    `rms_claim`: the size this member tells the group its update has (0: the true one).
    `give_up`: once it says so, a round still looking for its group stops looking (RoundFailed);
    one that found its group runs to its end."""

    def write(piece, out):
        out.copy_(delta[piece.offset : piece.offset + piece.numel])

    rms = rms_claim or float(delta.pow(2).mean().sqrt())
    info = {"name": name, "round": 0, "sketch": [sketch] * 64, "update_size": 1.0, "rms": rms}
    began = time.monotonic()
    avg.start(write, weight, lambda: info)
    while not avg.done():
        if give_up is not None and give_up() and not avg.group_found():
            avg.cancel()
            raise RoundFailed("gave up looking for a group")
        time.sleep(0.05)
    result = avg.result()
    flat = torch.empty(delta.numel())
    with avg.averaged() as pairs:
        for piece, (mean, _own) in zip(avg.pieces, pairs, strict=True):
            flat[piece.offset : piece.offset + piece.numel] = mean.float()
    return {
        "delta": flat,
        "group": result.group_size,
        "in_sync": result.in_sync,
        "round_s": time.monotonic() - began,
        "attempts": avg.attempts,  # groups it ran its all-reduce with (a lost try, then another)
    }


def live_others(index: int, work: Path, dht: DHT, peers: int | None = None) -> list[str]:
    """`peers` (else HARNESS_PEERS): this peer's ID written, the others' read once all are
    there."""
    peers = int(os.environ.get("HARNESS_PEERS", "0")) if peers is None else peers
    if not peers:
        return []
    own = dht.peer_id.to_base58()
    (work / f".id{index}.tmp").write_text(own)  # (whole before the glob below sees it)
    (work / f".id{index}.tmp").rename(work / f"id{index}")
    while len(list(work.glob("id[0-9]*"))) < peers:
        time.sleep(0.05)
    ids = [f.read_text() for f in sorted(work.glob("id[0-9]*"))]
    also = [p for p in os.environ.get("HARNESS_ALSO_LIVE", "").split(",") if p]
    return [p for p in ids if p != own] + also


def main() -> None:
    index, weight, work = int(sys.argv[1]), float(sys.argv[2]), Path(sys.argv[3])
    logging.basicConfig(format=f"h{index} %(asctime)s %(name)s: %(message)s")
    logging.getLogger("atomtrain").setLevel(logging.INFO)
    compression = sys.argv[4] if len(sys.argv) > 4 else "float16"
    sketch = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
    addr_file = work / "addr"
    if index == 0:
        dht = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
        # written whole before it appears (a peer that read it half-written could not bootstrap)
        (work / "addr.tmp").write_text(str(dht.get_visible_maddrs()[0]))
        (work / "addr.tmp").rename(addr_file)
    else:
        while not addr_file.exists():
            time.sleep(0.1)
        dht = DHT(
            initial_peers=[addr_file.read_text()], host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True
        )
    others = live_others(index, work, dht)
    avg = ProbedAverager(
        dht,
        "harness",
        cut_pieces({"a": 1000, "b": NUMEL - 1000}),
        compression,
        matchmaking_s=float(os.environ.get("HARNESS_MATCHMAKING_S", "3.0")),
        timeout_s=30.0,
        target_group_size=8,
        state_provider=lambda: ({}, []),
        start_timeout_s=START_TIMEOUT_S,
        live_others=lambda: others,
        assemble_early=ALWAYS if others else RETRIES,
    )
    out = averaged_round(avg, vectors(index), weight, f"h{index}", sketch=sketch)
    torch.save(out, work / f"out{index}.pt")
    avg.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main()
