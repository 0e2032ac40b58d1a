"""The averager's shutdown with a round in flight (hivemind 1.1.12's raised at every such exit)."""

import asyncio
from types import SimpleNamespace

from atomtrain.peer.guarded import GuardedAverager


def test_shutting_down_mid_round_cancels_the_runner_and_the_groups_not_yet_started():
    """hivemind's `_shutdown` calls `finalize` on each running group's future, which has none:
    an AttributeError and a traceback in the averager's thread when a peer stops mid-round (seen
    at the end of a 4-peer quick bench scaling). Ours cancels a started round's runner and the
    future of a group not yet started, and raises nothing."""
    cancelled = []
    runner = SimpleNamespace(finalize=lambda *, cancel: cancelled.append(cancel))

    async def shut() -> tuple[asyncio.Future, asyncio.Future]:
        loop = asyncio.get_running_loop()
        started, waiting, failed = loop.create_future(), loop.create_future(), loop.create_future()
        started.set_result(runner)
        failed.set_exception(RuntimeError("its matchmaking failed"))
        avg = GuardedAverager.__new__(GuardedAverager)
        avg.client_mode, avg._parent_pid = True, None  # (no handlers, no process)
        avg._running_groups = {b"a": started, b"b": waiting, b"c": failed}
        await GuardedAverager._shutdown(avg, timeout=1.0)
        return started, waiting

    started, waiting = asyncio.run(shut())
    assert cancelled == [True] and waiting.cancelled() and started.done()
