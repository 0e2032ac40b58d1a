"""One peer of the averaging-round test, run as its own process:

    python peer_round_harness.py INDEX WEIGHT WORKDIR

Peer 0 starts the DHT and writes its address to WORKDIR/addr; others join it. Each peer averages
its own known vectors once and saves what came back to WORKDIR/out{INDEX}.pt.
"""

import sys
import time
from pathlib import Path

import torch
from hivemind import DHT

from atomtrain.peer.averaging import ProbedAverager

NUMEL = 5000


def vectors(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(index)
    return torch.randn(NUMEL, generator=g), torch.randn(NUMEL, generator=g)


def main() -> None:
    index, weight, work = int(sys.argv[1]), float(sys.argv[2]), Path(sys.argv[3])
    addr_file = work / "addr"
    if index == 0:
        dht = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
        addr_file.write_text(str(dht.get_visible_maddrs()[0]))
    else:
        while not addr_file.exists():
            time.sleep(0.1)
        dht = DHT(
            initial_peers=[addr_file.read_text()], host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True
        )
    avg = ProbedAverager(
        dht,
        "harness",
        NUMEL,
        "float16",
        matchmaking_s=3.0,
        timeout_s=30.0,
        target_group_size=8,
        state_provider=lambda: ({}, []),
    )
    delta, theta = vectors(index)
    avg.start(delta, theta, weight, {"name": f"h{index}"})
    while not avg.done():
        time.sleep(0.05)
    result = avg.result()
    torch.save(
        {"delta": result.delta, "theta": result.theta_sync, "group": result.group_size},
        work / f"out{index}.pt",
    )
    avg.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main()
