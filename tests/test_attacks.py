"""The poisoned contributions `bench attack` sends: each is what its paper describes."""

import pytest
import torch

from atomtrain.bench.attack_report import (
    NEUTRALIZED_WITHIN,
    SwarmRun,
    attack_report,
    counted_late,
)
from atomtrain.errors import AtomError
from atomtrain.peer.attack import (
    ALIE_Z,
    ATTACKS,
    IPM_EPSILON,
    LabelFlippedLoader,
    check_attack,
    poison,
)
from atomtrain.peer.exclusion import OPPOSED_COSINE


def honest() -> torch.Tensor:
    return torch.randn(1000, generator=torch.Generator().manual_seed(0))


def test_model_poisoning_attacks_transform_the_honest_update():
    d = honest()
    assert torch.equal(poison("sign_flip", d), -d)
    assert torch.allclose(poison("ipm", d), -IPM_EPSILON * d)
    alie = poison("alie", d)
    # every coordinate moved down by z of its spread: a little, one way, never more than 2|d|
    assert torch.allclose(d - alie, ALIE_Z * d.abs())
    assert (alie <= d).all() and (alie.abs() <= 2 * d.abs() + 1e-7).all()
    assert float(alie.sum()) < float(d.sum())  # a net pull in one direction
    assert torch.equal(poison("label_flip", d), d)  # poisons the data, not the update
    assert not torch.isfinite(poison("nan", d)).any()


class Source:
    def __init__(self) -> None:
        self.calls = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        return torch.tensor([[1, 2, 3]]), torch.tensor([[2, 3, 0]])

    def state_dict(self) -> dict:
        return {"calls": self.calls}


def test_label_flip_trains_on_flipped_targets_and_keeps_the_loaders_state():
    loader = LabelFlippedLoader(Source(), vocab_size=10)
    x, y = loader.next_batch()
    assert x.tolist() == [[1, 2, 3]] and y.tolist() == [[7, 6, 9]]
    assert loader.state_dict() == {"calls": 1}  # checkpoints see the real loader


def test_every_attack_is_accepted_and_others_named():
    for kind in ATTACKS:
        check_attack(kind)
    with pytest.raises(AtomError, match="sign_flip"):
        check_attack("flip")


def run(
    losses: list[float], attacker: str | None = "a", banned_after: int | None = None
) -> SwarmRun:
    """Honest peers h0, h1 with these final losses; the attacker in each group until banned."""
    logs = []
    for loss in losses:
        log: list[dict] = []
        for rnd in range(5):
            rejected = [attacker] if banned_after is not None and rnd >= banned_after else []
            group = ["h0", "h1"] + ([attacker] if attacker and not rejected else [])
            log.append(
                {"round": rnd + 1, "group": group, "rejected_peers": rejected, "round_s": 1.0}
            )
        log.append({"val_loss": loss})
        logs.append(log)
    return SwarmRun(honest=["h0", "h1"], attacker=attacker, records=logs)


def test_the_attack_report_compares_with_clean_and_counts_rounds_until_rejected():
    clean = [run([3.0, 3.0], None), run([3.2, 3.2], None), run([3.1, 3.1], None)]
    cases = {
        "nan": {
            "defended": [run([3.1, 3.1], banned_after=1), run([3.2, 3.2], banned_after=2)],
            "undefended": [run([float("nan"), 9.0]), run([8.0, 8.0])],
        },
        "alie": {"defended": [run([3.5, 3.5])], "undefended": [run([4.0, 4.0])]},
    }
    del clean[1].records[1][3]["round_s"]  # a round h1 did not apply (a log line all the same)
    out = attack_report(clean, cases, OPPOSED_COSINE)
    assert out["clean_final_loss"]["median"] == pytest.approx(3.1)
    assert out["clean_rounds_applied"] == [5, 4, 5]  # the fewest an honest peer applied
    nan, alie = out["attacks"]
    assert nan["final_loss_defended"]["median"] == pytest.approx(3.15)
    assert nan["final_loss_undefended"]["per_seed"] == [None, 8.0]  # a diverged seed: worst
    assert nan["final_loss_undefended"]["median"] is None
    assert nan["defended_within_5pct"] and nan["honest_peers_rejected"] == 0
    assert [n["rounds_until_rejected"] for n in nan["neutralized"]] == [1, 2]
    assert alie["neutralized"][0]["rounds_until_rejected"] is None  # never rejected: bounded only
    assert alie["neutralized"][0]["rounds_applied_with_attacker"] == 5
    assert not alie["defended_within_5pct"]  # 3.5 is 13% above 3.1
    assert nan["rounds_applied_defended"] == [5, 5] and alie["rounds_applied_undefended"] == [5]
    assert nan["rounds_failed_defended"] == [0, 0] and nan["failed_round_s_defended"] == [None] * 2
    stalled = run([3.1, 3.1], attacker=None)
    stalled.records[0][2] = {"round": 3, "failed_round_s": 4.0}  # h0 failed two rounds
    stalled.records[0][4] = {"round": 5, "failed_round_s": 6.0}
    stalled.records[1][2] = {"round": 3, "failed_round_s": 11.0}  # h1 one
    x = attack_report(clean, {"stall": {"defended": [stalled]}}, OPPOSED_COSINE)["attacks"][0]
    assert x["rounds_failed_defended"] == [2] and x["failed_round_s_defended"] == [6.0]
    assert x["lost_attempt_cost_defended"] == [{"n": 0}]  # (no attempts recorded)
    for log in stalled.records:  # rounds that landed at their first attempt take 1 s
        for r in log[:-1]:
            r["round_attempts"] = 1
    stalled.records[0][1].update(round_s=2.5, round_attempts=2)  # landed after a retry
    stalled.records[1][2]["round_attempts"] = 0  # found no group: not a lost all-reduce
    x = attack_report(clean, {"stall": {"defended": [stalled]}}, OPPOSED_COSINE)["attacks"][0]
    cost = x["lost_attempt_cost_defended"][0]
    # landed after a retry in 2.5 s: 1.5 rounds more; failed after 4 s and 6 s: 4 and 6 lost
    assert cost["n"] == 3 and cost["typical_round_s"] == 1.0
    assert cost["median"] == pytest.approx(4.0) and cost["max"] == pytest.approx(6.0)
    honest_banned = run([3.1, 3.1], banned_after=0)
    honest_banned.records[0][0]["rejected_peers"] = ["h1"]
    assert (
        attack_report(clean, {"x": {"defended": [honest_banned]}}, OPPOSED_COSINE)["attacks"][0][
            "honest_peers_rejected"
        ]
        == 1
    )


def test_the_attack_report_counts_exclusions_apart_from_bans():
    """A lying reducer is left out for a while (stalled_peers), never banned: the report says
    when each honest peer first left it out, and names an honest peer left out by another."""
    clean = [run([3.0, 3.0], None)]
    liar = run([3.0, 3.0])
    for log in liar.records:
        for r in log[1:5]:  # caught in round 1's audit: never in an applied round again
            r["group"] = ["h0", "h1"]
        log[0]["group"] = ["h0", "h1"]  # its round 1 was discarded: not applied with it
        log[1]["stalled_peers"] = ["a"]
    report = attack_report(clean, {"lying_reducer": {"defended": [liar]}}, OPPOSED_COSINE)[
        "attacks"
    ][0]
    (n,) = report["neutralized"]
    assert n["rounds_until_rejected"] is None and not n["rejected_by_all"]
    assert n["rounds_until_left_out"] == 0 and n["left_out_by_all"]
    assert n["rounds_applied_with_attacker"] == 0
    assert report["honest_peers_left_out"] == 0 and report["honest_peers_rejected"] == 0
    liar.records[0][2]["stalled_peers"] = ["h1"]  # an honest peer blamed
    report = attack_report(clean, {"lying_reducer": {"defended": [liar]}}, OPPOSED_COSINE)[
        "attacks"
    ][0]
    assert report["honest_peers_left_out"] == 1


def test_the_attack_report_counts_the_rounds_that_averaged_the_attackers_update_in():
    """An attacker in a round out of sync had its update left out (sync.py): of the rounds
    applied with it, only those with it in sync averaged it in."""
    clean = [run([3.0, 3.0], None)]
    drifter = run([3.0, 3.0])
    for log in drifter.records:
        for i, r in enumerate(log[:5]):  # in sync in its first 2 rounds, then drifted
            r["round_members"] = [["h0", True], ["h1", True], ["a", i < 2]]
        del log[3]["round_s"], log[3]["group"]  # failed: it counts nothing, in sync or not
        log[3]["round_members"] = [["h0", True], ["h1", True], ["a", True]]
    report = attack_report(clean, {"sign_flip": {"defended": [drifter]}}, OPPOSED_COSINE)[
        "attacks"
    ][0]
    (n,) = report["neutralized"]
    assert n["rounds_applied_with_attacker"] == 4 and n["rounds_counted_with_attacker"] == 2
    assert n["rounds_counted_with_attacker_late"] == 0  # (landed rounds 0 and 1: before 3)
    sybils = SwarmRun(honest=["h0"], attacker="a", sybils=["b"], records=[drifter.records[0]])
    drifter.records[0][4]["round_members"] = [["h0", True], ["b", True]]
    report = attack_report(clean, {"sybil": {"defended": [sybils]}}, OPPOSED_COSINE)
    (n,) = report["attacks"][0]["neutralized"]
    assert n["rounds_counted_with_attacker"] == 3 and n["rounds_counted_with_attacker_late"] == 1
    assert NEUTRALIZED_WITHIN == 3 and drifter.records[0][4]["round"] == 5
    # a landed round's record holds the next round's number: landed round 2 (record 3) is
    # within the first three rounds, landed round 3 (record 4) is not
    rounds = [{"round": n, "round_s": 1.0, "round_members": [["a", True]]} for n in (3, 4)]
    assert counted_late(rounds, {"a"}) == 1


def test_the_attack_report_gives_the_agreement_the_honest_reducers_read():
    """The cosines in the honest peers' metrics (`agreement`): the attacker's apart from the
    honest peers', and how many honest readings fell where the rule counts against a member; the
    leans (a fourth field since e37b844, projected since 8d7317d; None where not read): the honest
    ones' absolute values, the attacker's as they are."""
    clean = [run([3.0, 3.0], None)]
    flipper = run([3.0, 3.0])
    flipper.records[0][0]["agreement"] = [["h1", "id1", 0.5, -0.02], ["a", "idA", -0.6, -0.7]]
    flipper.records[0][1]["agreement"] = [["h1", "id1", -0.35, None], ["a", "idA", -0.4]]
    flipper.records[1][0]["agreement"] = [["h0", "id0", 0.7, 0.01], ["a", "idA", 0.1, -0.5]]
    report = attack_report(clean, {"sign_flip": {"defended": [flipper]}}, OPPOSED_COSINE)
    (seen,) = report["attacks"][0]["agreement_defended"]
    assert seen["attacker"] == {"n": 3, "min": -0.6, "median": -0.4, "max": 0.1}
    assert seen["honest"]["n"] == 3 and seen["honest"]["median"] == 0.5
    assert seen["honest_below"] == 1  # -0.35, below -0.3
    assert seen["honest_lean"] == {"n": 2, "min": 0.01, "median": 0.015, "max": 0.02}
    assert seen["honest_lean_at_bar"] == 0
    assert seen["attacker_lean"] == {"n": 2, "min": -0.7, "median": -0.6, "max": -0.5}
    assert report["clean_agreement"] == [
        {"honest": {"n": 0}, "honest_below": 0, "honest_lean": {"n": 0}, "honest_lean_at_bar": 0}
    ]
    assert report["opposed_cosine"] == OPPOSED_COSINE


def test_each_peer_of_an_attack_swarm_runs_under_its_own_cpu_quota(tmp_path):
    """bench attack gives every peer process the same cores in every swarm (an attack's swarm
    has one process more than the clean one): each joins its own group before it execs, so its
    helpers count against that quota too."""
    import sys

    from atomtrain.bench.attack import _swarm
    from atomtrain.bench.cgroup import CpuQuotas

    quotas = CpuQuotas(0.5, root=tmp_path)  # the groups' files only, no cgroup mounted here
    swarm = _swarm(quotas, "s", tmp_path / "out", "s0-clean-defended", [], expected=4)
    assert swarm.threads == 1  # as many as the quota has whole cores, at least one
    swarm.peer_args = lambda i, n, join: [sys.executable, "-c", "import os; print(os.getpid())"]
    peers = [swarm.launch(i, 2, None) for i in range(2)]
    for peer in peers:
        assert peer.proc.wait(timeout=30) == 0
        group = tmp_path / f"{quotas.tag}-s0-clean-defended-peer{peer.index}"
        assert (group / "cpu.cfs_quota_us").read_text() == "50000"
        pid = int(peer.log_path.read_text())  # the peer's own, exec'd in the shell's place
        assert int((group / "cgroup.procs").read_text()) == pid == peer.proc.pid
    assert _swarm(None, "s", tmp_path / "out", "plain", []).wrap is None


def test_bench_attack_checks_its_cpu_quota_in_one_line(tmp_path, monkeypatch, capsys):
    """`--cpu-per-peer`: auto splits this machine's cores among an attack swarm's peers where
    quotas can be set, and says where they cannot; a bad value, or a quota without root, is a
    one-line error."""
    import os
    import subprocess
    import sys

    from atomtrain.bench import cgroup
    from atomtrain.cli import bench_cmd

    monkeypatch.setattr(cgroup, "cpu_cgroups_usable", lambda root=None: True)
    cores = len(os.sched_getaffinity(0))
    assert bench_cmd._cpu_per_peer("auto", 4) == round(cores / 4, 3)
    assert bench_cmd._cpu_per_peer("0.25", 4) == 0.25
    monkeypatch.setattr(cgroup, "cpu_cgroups_usable", lambda root=None: False)
    assert bench_cmd._cpu_per_peer("auto", 4) == 0.0
    assert "no CPU quotas" in capsys.readouterr().err
    assert bench_cmd._cpu_per_peer("0", 4) == 0.0
    wrong = f"--cpu-per-peer must be auto, 0 or 0.01-{cores} cores, got"
    for value, message in (
        ("-1", f"{wrong} '-1'"),
        ("lots", f"{wrong} 'lots'"),
        ("inf", f"{wrong} 'inf'"),
        ("0.001", f"{wrong} '0.001'"),  # under the kernel's least quota
        (str(cores + 1), f"{wrong} '{cores + 1}'"),
        ("0.5", "--cpu-per-peer needs root and cgroup v1 `cpu` mounted read-write"),
    ):
        code = (
            "import os; os.geteuid = lambda: 1000\n"
            "import sys; from atomtrain.cli.main import main\n"
            f"sys.exit(main(['bench', 'attack', '--json', '--cpu-per-peer={value}']))"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=60
        )
        assert proc.returncode == 2 and proc.stdout == "", proc.stderr
        assert proc.stderr.strip() == f"atomtrain: error: {message}", value
        assert not (tmp_path / "runs").exists()  # nothing started, nothing removed


def test_the_attack_report_replays_the_update_rules_on_the_logged_readings():
    """follow_replay: the ledger's rules run over each honest peer's logged readings: the
    flipper left out once its third round with this peer is over, an honest member that
    followed weakly in one round of three never (it is judged: another member reaches the
    floor), nor anyone in a clean run; a member read twice in one record is two tries, each
    judged by the opposing rule (one far below names it at once, whatever the other)."""
    from atomtrain.bench.attack_report import follow_replay

    flipper = run([3.0, 3.0])
    for k, log in enumerate(flipper.records):
        other = f"h{1 - k}"
        for i, r in enumerate(log[:4]):
            r["round"] = i
            r["agreement"] = [
                [other, "id", 0.15 if i == 1 else 0.7],
                ["c", "idC", 0.7],
                ["a", "idA", 0.02],
            ]
    report = attack_report([run([3.0, 3.0], None)], {"label_flip": {"defended": [flipper]}}, -0.3)
    (replay,) = report["attacks"][0]["follow_replay_defended"]
    assert replay == {
        "honest_left_out_for_following": 0,
        "honest_left_out_for_leaning": 0,
        "attacker_left_out_at_reading": [3, 3],
    }
    assert report["clean_follow_replay"] == [
        {
            "honest_left_out_for_following": 0,
            "honest_left_out_for_leaning": 0,
            "attacker_left_out_at_reading": [None, None],
        }
    ]
    assert follow_replay(flipper) == replay
    for log in flipper.records:  # an honest member far off in two rounds of three: left out
        log[1]["agreement"][0][2] = log[2]["agreement"][0][2] = 0.05
    assert follow_replay(flipper)["honest_left_out_for_following"] == 2
    opposed = run([3.0, 3.0])
    for log in opposed.records:
        log[0]["round"] = 0
        log[0]["agreement"] = [
            ["c", "idC", 0.7], ["a", "idA", -0.6], ["c", "idC", 0.7], ["a", "idA", 0.2],
        ]  # fmt: skip
    assert follow_replay(opposed)["attacker_left_out_at_reading"] == [1, 1]
    leaning = run([3.0, 3.0])  # ALIE: its cosine an honest member's, its lean far off
    for k, log in enumerate(leaning.records):
        for i, r in enumerate(log[:3]):
            r["round"] = i
            r["agreement"] = [
                [f"h{1 - k}", "id", 0.7, 0.01],
                ["a", "idA", 0.45, -0.7 if i else 0.0],
            ]
    assert follow_replay(leaning)["attacker_left_out_at_reading"] == [2, 2]
    assert follow_replay(leaning)["honest_left_out_for_leaning"] == 0
    for log in leaning.records:  # an honest member leaning in one round: counted
        log[2]["agreement"][0][3] = 0.3
    assert follow_replay(leaning)["honest_left_out_for_leaning"] == 2
