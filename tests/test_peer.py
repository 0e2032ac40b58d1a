"""Real peers on 127.0.0.1: hivemind daemons, one process per peer, every child reaped."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from atomtrain.peer.churn import ChurnConfig, run_churn
from atomtrain.train.checkpoint import latest_checkpoint
from atomtrain.train.loading import load_trained
from atomtrain.train.metrics import read_metrics

from .conftest import run_cli
from .peer_round_harness import vectors

HERE = Path(__file__).parent

# Why peers agree to 1e-3 after the last round: it averages parameters exactly (float32), but
# the pseudo-gradient travels in float16, so a peer's own part of the average is full precision
# and the parts it receives are rounded to 2^-11 relative. Pseudo-gradients here stay below 0.5,
# so two peers' final parameters differ by at most about 0.5 * 2^-11 = 2.4e-4.
AGREEMENT_TOL = 1e-3

SMALL = [
    "--model.preset=small",
    "--data.seq_len=64",
    "--data.rows=8",
    "--train.micro_batch_rows=8",
    "--train.warmup_steps=10",
    "--train.eval_interval=50",
    "--train.lr=2e-3",
]


def round_of_harnesses(args: list[list[str]], env: dict[str, str] | None = None) -> None:
    """One averaging round of peer_round_harness.py processes, peer i with args[i] (`env`: more
    of the harness's settings)."""
    harness = [sys.executable, str(HERE / "peer_round_harness.py")]
    env = {**os.environ, **(env or {})}
    procs = [subprocess.Popen([*harness, str(i), *a], env=env) for i, a in enumerate(args)]
    try:
        for p in procs:
            assert p.wait(timeout=120) == 0
    finally:
        for p in procs:
            p.kill()


@pytest.mark.parametrize(
    ("compression", "max_error", "rms_error"),
    # float16: 2^-11 relative to values of a few units, with room for two roundings; 8 bits:
    # half a step (a block's range / 255) on the way out and again on the way back; 4 bits:
    # about half a bin (6 sigma / 16) each way, and values beyond 3 sigma clipped to the outer
    # bin (error feedback carries the rest)
    [("float16", 4 * 2**-11 * 5, 1e-3), ("int8", 0.1, 0.02), ("int4", 1.5, 0.2)],
)
def test_one_round_equals_the_token_weighted_mean(
    tmp_path: Path, compression: str, max_error: float, rms_error: float
):
    weights = [1.0, 3.0]
    round_of_harnesses([[str(w), str(tmp_path), compression] for w in weights])
    deltas = [vectors(i) for i in range(2)]
    want = sum(w * d for w, d in zip(weights, deltas, strict=True)) / sum(weights)
    outs = [torch.load(tmp_path / f"out{i}.pt") for i in range(2)]
    # both hold the same bits of the average, whoever reduced each span (peer/exact.py): a
    # member that holds other synchronized parameters stands out in every round
    assert torch.equal(outs[0]["delta"], outs[1]["delta"])
    for out in outs:
        assert out["group"] == 2
        error = out["delta"] - want
        assert float(error.abs().max()) <= max_error
        assert float(error.pow(2).mean().sqrt()) <= rms_error


def test_an_undefended_round_leaves_out_the_update_of_a_member_out_of_sync(tmp_path: Path):
    # peer 2 holds other synchronized parameters (a round it missed): its update holds progress
    # the others averaged in already, so it weighs nothing; it learns it is out of sync
    weights, sketches = [1.0, 2.0, 3.0], [0.0, 0.0, 5.0]
    round_of_harnesses(
        [[str(w), str(tmp_path), "float16", str(s)] for w, s in zip(weights, sketches, strict=True)]
    )
    want = (1.0 * vectors(0) + 2.0 * vectors(1)) / 3.0
    outs = [torch.load(tmp_path / f"out{i}.pt") for i in range(3)]
    for out in outs:
        assert out["group"] == 3
        assert sorted(out["in_sync"]) == [False, True, True]  # (in the group's order)
        assert torch.equal(out["delta"], outs[0]["delta"])
        assert float((out["delta"] - want).abs().max()) <= 4 * 2**-11 * 5


def test_a_leader_forms_its_group_once_every_live_member_joined(tmp_path: Path):
    # each knows the two others are live (assembly.py, `always`, which the harness sets: peers
    # form only a retry's group early, test_security): the group forms as the last joins, long
    # before the 20 s matchmaking time hivemind's leader would wait out in a swarm smaller than
    # its target group size (8 here)
    weights = [1.0, 2.0, 3.0]
    round_of_harnesses(
        [[str(w), str(tmp_path)] for w in weights],
        env={"HARNESS_PEERS": "3", "HARNESS_MATCHMAKING_S": "20"},
    )
    want = sum(w * vectors(i) for i, w in enumerate(weights)) / sum(weights)
    for i in range(3):
        out = torch.load(tmp_path / f"out{i}.pt")
        assert out["group"] == 3
        assert out["round_s"] < 10.0, out["round_s"]
        assert float((out["delta"] - want).abs().max()) <= 4 * 2**-11 * 5


def test_a_leader_waits_out_its_matchmaking_time_for_a_live_member_that_has_not_joined(
    tmp_path: Path,
):
    # a third live member (its status fresh, its peer ID real) never joins: the two that did
    # form their group only when the matchmaking time ends, as before
    from atomtrain.peer.certs import write_new_identity

    absent = write_new_identity(tmp_path / "absent.id").peer_id
    round_of_harnesses(
        [["1.0", str(tmp_path)], ["1.0", str(tmp_path)]],
        env={"HARNESS_PEERS": "2", "HARNESS_MATCHMAKING_S": "4", "HARNESS_ALSO_LIVE": absent},
    )
    outs = [torch.load(tmp_path / f"out{i}.pt") for i in range(2)]
    assert all(out["group"] == 2 for out in outs)
    # the leader's round ran its 4 s at least (the follower's began later, by the start skew)
    assert max(out["round_s"] for out in outs) >= 3.5, [out["round_s"] for out in outs]


def test_a_leader_counts_only_the_expected_members_it_does_not_leave_out():
    from atomtrain.peer.assembly import all_expected_joined

    def ok(p: str) -> bool:
        return p != "left-out"

    assert all_expected_joined("me", ["a", "b"], ["a", "b", "me"], ok)
    assert all_expected_joined("me", ["a", "b", "joiner"], ["a", "b"], ok)  # one not known yet
    assert not all_expected_joined("me", ["a"], ["a", "b"], ok)  # b is waited for
    assert all_expected_joined("me", ["a"], ["a", "left-out"], ok)  # left out: not waited for
    assert not all_expected_joined("me", ["a"], [], ok)  # none expected: hivemind's rule
    assert not all_expected_joined("me", [], ["left-out"], ok)  # never a group of one
    # never a group smaller than the round's quorum: one that could not be applied waits
    assert not all_expected_joined("me", ["a"], ["a", "left-out"], ok, least=3)
    assert all_expected_joined("me", ["a", "b"], ["a", "b", "left-out"], ok, least=3)
    # every expected one a suspect: a quorum of them back is enough, fewer is not
    assert all_expected_joined("me", ["a", "b"], ["a", "b", "c"], lambda p: False, least=3)
    assert not all_expected_joined("me", ["a"], ["a", "b", "c"], lambda p: False, least=3)


def test_a_leader_forms_no_group_smaller_than_the_quorum_those_it_waits_for_can_make_up():
    from atomtrain.peer.assembly import least_group

    def ok(p: str) -> bool:
        return p != "left-out"

    assert least_group("me", ["a", "b"], ok, quorum=3) == 3  # a pair could not be applied
    assert least_group("me", ["a", "b", "c"], ok, quorum=3) == 3
    # those it waits for cannot make up the quorum: hivemind's 2, a pair fails at once as before
    assert least_group("me", ["a", "left-out"], ok, quorum=3) == 2
    assert least_group("me", [], ok, quorum=3) == 2
    assert least_group("me", ["me", "a"], ok, quorum=3) == 2  # itself counted once
    assert least_group("me", ["a"], ok, quorum=2) == 2  # an open swarm applies pairs


def test_a_member_a_try_ended_early_over_is_not_waited_for_in_the_retry_until_it_takes_part():
    from atomtrain.peer.assembly import SUSPECT_ROUNDS, Suspects

    suspects = Suspects()
    suspects.tried(["a", "b", "staller"], {"staller"}, round_=1)
    assert "staller" in suspects and "a" not in suspects  # not waited for in the retry
    suspects.next_round(1)  # (a later try of the same round)
    assert "staller" in suspects
    for r in range(2, 2 + SUSPECT_ROUNDS):
        suspects.next_round(r)
        assert "staller" in suspects, r
    suspects.next_round(2 + SUSPECT_ROUNDS)
    assert "staller" not in suspects  # an honest member frozen once is waited for again
    suspects.tried(["a", "staller"], {"staller"}, round_=9)
    suspects.tried(["a", "staller"], set(), round_=9)  # it took part in the retry
    assert "staller" not in suspects


def test_the_live_members_list_keeps_only_peer_ids_and_reaches_the_averagers_process():
    import multiprocessing as mp

    from atomtrain.peer.assembly import ExpectedMembers

    ids = ["12D3KooW" + "x" * 44, "QmY" + "y" * 43]
    members = ExpectedMembers(8)
    members.write(ids)
    child = mp.get_context("fork").Process(target=lambda: sys.exit(members.read() != ids))
    child.start()  # (made before the fork, as the averager's process is)
    child.join(30)
    assert child.exitcode == 0
    members.write([])
    assert members.read() == []
    members.write([f"{i + 1}" * 50 for i in range(8)])  # as many as the target: hivemind's rule
    assert members.read() == []
    # what a status may claim in an open swarm: a NUL would end the list, a newline split an
    # entry, anything not base58 name no peer (dropped: never waited for, nor ending the list)
    members.write([ids[0] + "\x00", "a\nb", "0OIl" * 10, ids[1], "", "x" * 200])
    assert members.read() == [ids[1]]


def test_the_4bit_codec_packs_two_values_a_byte_and_keeps_bucket_means():
    from hivemind.compression import CompressionInfo, deserialize_torch_tensor

    from atomtrain.peer.codecs import Uniform4BitQuantization

    x = torch.randn(1001, generator=torch.Generator().manual_seed(0))
    codec = Uniform4BitQuantization()
    wire = codec.compress(x, CompressionInfo.from_tensor(x))
    assert len(wire.buffer) == 16 * 4 + 501  # codebook, then two indices a byte
    back = deserialize_torch_tensor(wire)  # through hivemind's registry, as a peer reads it
    assert back.shape == x.shape and back.dtype == x.dtype
    assert float((back - x).pow(2).mean().sqrt()) < 0.15  # 6 sigma over 16 bins
    assert abs(float(back.sum() - x.sum())) < 1e-2  # bucket means: the sum is kept


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None
    return load_file(ckpt / "model.safetensors")


@pytest.fixture(scope="module")
def churn(tmp_path_factory: pytest.TempPathFactory):
    """One churn scenario. On 2 loaded cores its rounds sometimes miss each other (a joiner that
    downloads before any round landed, or a last group that leaves a peer out); such a run is
    repeated once, and the note on issue #4 records this timing sensitivity."""
    cfg = ChurnConfig(peers=3, steps=160, sync_every=10, averaging_timeout_s=20.0)
    outcome = run_churn(cfg, tmp_path_factory.mktemp("churn"))
    joined = re.search(r"joined at round (\d+)", outcome.logs.get(3, ""))
    if outcome.result["param_spread"] > AGREEMENT_TOL or not joined or joined.group(1) == "0":
        outcome = run_churn(cfg, tmp_path_factory.mktemp("churn-again"))
    return outcome


def test_survivors_of_a_killed_peer_finish_their_rounds(churn):
    survivors = churn.swarm.peers[:2]
    assert all(p.proc.returncode == 0 for p in survivors)
    assert churn.result["survivor_steps_lost"] == 0
    assert churn.result["max_survivor_stall_s"] <= churn.result["averaging_timeout_s"]
    for p in survivors:  # rounds went on after the kill
        rounds = [r.get("round", 0) for r in read_metrics(p.run_dir / "metrics.jsonl")]
        assert max(rounds) >= 3


def test_no_helper_process_outlives_its_peer(churn):
    assert churn.killed_helpers_alive == []


def test_a_late_joiner_takes_the_swarms_parameters(churn):
    joined = re.search(r"joined at round (\d+) .*parameters (\w+)\)", churn.logs[3])
    assert joined, churn.logs[3][-2000:]
    served = {
        m
        for i in (0, 1)
        for m in re.findall(r"served the state of round (\d+) \(parameters (\w+)\)", churn.logs[i])
    }
    assert (joined.group(1), joined.group(2)) in served
    assert int(joined.group(1)) >= 1
    # its learning rate follows the swarm's schedule: no second warmup from zero
    joiner = churn.swarm.peers[3]
    first = next(r for r in read_metrics(joiner.run_dir / "metrics.jsonl") if "lr" in r)
    # (its own warmup would start at 2e-4; the swarm's cosine never goes below min_lr, 3e-4)
    assert first["lr"] >= 3e-4, first


def test_a_restarted_peer_resumes_from_its_checkpoint_and_catches_up(churn):
    log = churn.logs[2]
    assert "resuming" in log and re.search(r"resumed at round \d+ from the checkpoint", log)
    restarted = churn.swarm.peers[-1]
    assert restarted.index == 2 and restarted.proc.returncode == 0


def test_finishers_agree_after_the_last_round(churn):
    assert churn.result["finished_peers"] == 4, churn.result
    assert churn.result["param_spread"] <= AGREEMENT_TOL, churn.result


def test_machines_started_as_the_readme_says_each_do_their_own_work(tmp_path: Path):
    """`atomtrain train --swarm NAME` on one machine, `... --join ADDR` on another: no index is
    given, yet each peer reads its own batches, keeps its own status record, and a fresh swarm
    needs no state download (every peer built the same initial weights from the seed)."""
    import os

    common = [*SMALL, "--train.steps=150", "--peer.sync_every=10", "--quiet", "--no-sample"]
    common.append("--train.ema=0.9")  # with weight averages: the last round takes them in
    # a round still looking for its group as the other peer finishes runs to this timeout
    # (finish.py), 30 s by default: rounds here take 3 s
    common.append("--peer.averaging_timeout_s=10")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    machines = [tmp_path / "m1", tmp_path / "m2"]
    procs, logs = [], []
    try:
        for i, cwd in enumerate(machines):
            cwd.mkdir()
            args = ["train", "--swarm", "readme", *common]
            if i == 1:
                (peer_json,) = wait_for_files(machines[0] / "runs", "peer.json")
                addr = json.loads(peer_json.read_text())["addrs"][0]
                args = ["train", "--swarm", "readme", "--join", addr, *common]
            log = open(cwd / "log", "w")  # noqa: SIM115 (closed below)
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "atomtrain.cli.main", *args],
                    cwd=cwd,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        rows = 0
        deadline = time.time() + 120
        while rows < 2 and time.time() < deadline and all(p.poll() is None for p in procs):
            status = run_cli(
                "status", "--join", addr, "--swarm", "readme", cwd=tmp_path, timeout=60
            )
            rows = status.stdout.count("peer-")
        assert rows == 2, status.stdout  # two records, one per peer
        for p in procs:
            assert p.wait(timeout=300) == 0
    finally:
        for p in procs:
            p.kill()
        for log in logs:
            log.close()
    second = (machines[1] / "log").read_text()
    assert "fresh swarm" in second and "joined at round" not in second, second[-2000:]
    for m in machines:  # two honest peers: neither left the other out for opposing updates
        # (with train.ema, their last round's readings of each other were -0.75 and -0.85, and
        # each named the other: guarded.reads_members)
        assert "opposite to this peer's" not in (m / "log").read_text(), (m / "log").read_text()
    runs = [next((m / "runs").iterdir()) for m in machines]
    ids = [json.loads((r / "peer.json").read_text())["peer_id"] for r in runs]
    assert ids[0] != ids[1]
    first_losses = [
        next(r["loss"] for r in read_metrics(run / "metrics.jsonl") if r.get("step") == 1)
        for run in runs
    ]
    assert first_losses[0] != first_losses[1]  # same weights, different batches
    for run in runs:  # both learnt, and averaged at least once
        vals = [r["val_loss"] for r in read_metrics(run / "metrics.jsonl") if "val_loss" in r]
        assert vals[-1] < vals[0] - 1.0
        assert json.loads((latest_checkpoint(run) / "state.json").read_text())["peer_round"] >= 1
    a, b = (final_params(r) for r in runs)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= AGREEMENT_TOL
    # what export, sample and serve load (the weight average) is the model the swarm agreed on
    exported = [dict(load_trained(r)[0].named_parameters()) for r in runs]
    for name, p in exported[0].items():
        assert float((p - exported[1][name]).detach().abs().max()) <= AGREEMENT_TOL, name
        assert torch.equal(p.detach(), a[name]), name


def wait_for_files(root: Path, name: str, timeout_s: float = 120) -> list[Path]:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        found = list(root.glob(f"*/{name}")) if root.exists() else []
        if found:
            return found
        time.sleep(0.2)
    raise TimeoutError(f"no {name} under {root}")


def test_ctrl_c_stops_a_swarm_peer_with_a_checkpoint(tmp_path: Path, prepared: Path):
    """hivemind ignores SIGINT in the process that starts an averager; a peer must still stop on
    Ctrl-C (from a terminal, or from `atomtrain swarm` stopping its peers), even when started by
    a process that ignores it."""
    import signal

    argv = [
        sys.executable, "-m", "atomtrain.cli.main", "train", "--quiet", "--no-sample",
        "--peer.swarm=ctrlc", f"--data.prepared={prepared}", "--model.preset=tiny",
        "--data.seq_len=32", "--train.steps=100000", "--train.eval_interval=1000000",
        "--train.checkpoint_interval=1000000", "--peer.final_wait_s=1",
        f"--run.out_dir={tmp_path / 'runs'}", "--run.name=p",
    ]  # fmt: skip
    log = tmp_path / "peer.log"  # (its exit is waited for, not the end of its output: conftest)
    with open(log, "w") as out_file:
        peer = subprocess.Popen(
            argv,
            cwd=tmp_path,
            stdout=out_file,
            stderr=subprocess.STDOUT,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),  # a background job
        )
    try:
        deadline = time.time() + 120
        metrics = tmp_path / "runs" / "p" / "metrics.jsonl"
        while time.time() < deadline and not any("round" in r for r in read_metrics(metrics)):
            assert peer.poll() is None, log.read_text()[-2000:]
            time.sleep(0.5)  # the averager is up once steps report their round
        peer.send_signal(signal.SIGINT)
        peer.wait(timeout=90)
    finally:
        if peer.poll() is None:
            peer.kill()
    out = log.read_text()
    assert peer.returncode == 130, out[-2000:]  # stopped by Ctrl-C, as a shell reports it
    assert "stopped early; continue with" in out
    assert latest_checkpoint(tmp_path / "runs" / "p") is not None
