"""The averager's shutdown with a round in flight (hivemind 1.1.12's raised at every such exit)."""

import asyncio
from types import SimpleNamespace

from atomtrain.peer.exact import ExactAverageRunner
from atomtrain.peer.guarded import GuardedAverager


def test_shutting_down_mid_round_cancels_the_runner_and_the_groups_not_yet_started():
    """hivemind's `_shutdown` calls `finalize` on each running group's future, which has none:
    an AttributeError and a traceback in the averager's thread when a peer stops mid-round (seen
    at the end of a 4-peer quick bench scaling). Ours cancels a started round's runner and the
    future of a group not yet started, leaves one already over (failed or cancelled) as it is,
    and raises nothing."""
    cancelled = []
    runner = SimpleNamespace(finalize=lambda *, cancel: cancelled.append(cancel))

    async def shut() -> dict[bytes, asyncio.Future]:
        loop = asyncio.get_running_loop()
        groups = {name: loop.create_future() for name in (b"started", b"waiting", b"failed", b"x")}
        groups[b"started"].set_result(runner)
        groups[b"failed"].set_exception(RuntimeError("its matchmaking failed"))
        groups[b"x"].cancel()
        avg = GuardedAverager.__new__(GuardedAverager)
        avg.client_mode, avg._parent_pid = True, None  # (no handlers, no process)
        avg._running_groups = dict(groups)
        await GuardedAverager._shutdown(avg, timeout=1.0)
        return groups

    groups = asyncio.run(shut())
    assert cancelled == [True]  # the started round's runner, once
    assert groups[b"waiting"].cancelled() and groups[b"x"].cancelled()
    assert isinstance(groups[b"failed"].exception(), RuntimeError)


def test_a_round_cancelled_at_shutdown_names_no_member_a_staller():
    """A member hivemind dropped for silence is named a staller when the round ends; not when
    this peer cancels the round as it shuts down (it would leave an honest peer out for
    nothing, and count in bench figures)."""
    named = []

    def runner() -> ExactAverageRunner:
        r = ExactAverageRunner.__new__(ExactAverageRunner)
        r._future = asyncio.Future(loop=asyncio.new_event_loop())
        r._silent, r._unheard, r._leader = lambda: ["quiet"], set(), "leader"
        r.peer_id, r.ordered_peer_ids = "me", ["me", "quiet"]  # (its repr, in a log line)
        r._stalled = lambda peer_id, why: named.append(peer_id)
        r.tensor_part_container = r.tensor_part_reducer = SimpleNamespace(finalize=lambda: None)
        return r

    runner().finalize(cancel=True)
    assert named == []
    runner().finalize()  # a round that ended: the silent member is named
    assert named == ["quiet"]
