"""The dashboard: what it collects and serves, and the page in a real browser (headless Chromium
from Debian's packages) against a real two-peer swarm started with `atomtrain swarm
--dashboard`."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from atomtrain.dashboard.collector import SwarmWatch
from atomtrain.dashboard.server import start_dashboard
from atomtrain.peer.status import PeerStatus, status_rows

ARTIFACTS = Path(os.environ.get("ATOM_TEST_ARTIFACTS", "test-artifacts"))


def status(name: str, step: int, loss: float, updated: float, **kw) -> PeerStatus:
    return PeerStatus(
        name=name,
        round=step // 10,
        step=step,
        loss=loss,
        tokens_per_s=1000.0,
        last_sync=updated - 1,
        updated=updated,
        peer_id=f"id-{name}",
        sent_bps=125_000.0,
        received_bps=250_000.0,
        round_bytes=2e6,
        round_s=2.0,
        matchmaking_s=0.5,
        success_share=0.9,
        **kw,
    )


def test_the_collector_keeps_each_peers_latest_record_and_its_loss_curve():
    now = time.time()
    watch = SwarmWatch(dht=None, swarm="s")
    b = status("b", 12, 3.1, now - 60, rejected=("a",))  # a minute old: a gone peer
    watch.collect([status("a", 10, 3.0, now - 2), b], now - 2)
    watch.collect([status("a", 10, 3.0, now - 2)], now - 1)  # the same record again
    watch.collect([status("a", 20, 2.5, now), status("b", 11, 3.3, now - 70)], now)  # older: kept
    snap = watch.snapshot()
    assert [p["name"] for p in snap["peers"]] == ["a", "b"]
    a, b = snap["peers"]
    assert snap["history"][a["key"]] == [[now - 2, 10, 3.0], [now, 20, 2.5]]
    assert a["live"] and not b["live"]  # b's record is a minute old: gone
    assert a["rejected_by"] == ["b"] and b["rejected_by"] == []
    assert snap["totals"]["live_peers"] == 1
    assert snap["totals"]["sent_bps"] == 125_000.0  # live peers only
    json.dumps(snap)  # what the server sends


def test_the_server_serves_the_page_its_assets_and_live_snapshots():
    now = time.time()
    watch = SwarmWatch(dht=None, swarm="s")
    watch.collect([status("<b>x</b>", 5, 4.0, now)], now)
    server = start_dashboard(watch, "127.0.0.1", 0)
    try:
        url = server.url()
        page = urllib.request.urlopen(url, timeout=10).read().decode()
        assert '<canvas id="loss-chart"' in page and "/app.js" in page
        assert "https://" not in page  # nothing from the internet
        for asset in ("app.js", "style.css"):
            assert urllib.request.urlopen(url + asset, timeout=10).status == 200
        snap = json.loads(urllib.request.urlopen(url + "api/swarm", timeout=10).read())
        assert snap["peers"][0]["name"] == "<b>x</b>"  # the page writes names as text
        with urllib.request.urlopen(url + "events", timeout=10) as events:
            assert events.headers["Content-Type"] == "text/event-stream"
            line = events.readline().decode()
            assert line.startswith("data: ") and json.loads(line[6:])["swarm"] == "s"
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url + "nope", timeout=10)
        assert e.value.code == 404
    finally:
        server.shutdown()


def test_network_figures_in_the_status_record_are_checked_and_tabled():
    good = status("a", 10, 3.0, time.time())
    from dataclasses import asdict, replace

    record = asdict(good)
    assert PeerStatus.from_record(record) == good
    for bad in (-1.0, float("nan"), float("inf"), "x"):
        assert PeerStatus.from_record({**record, "sent_bps": bad}) is None
    row = status_rows([good])[0]
    assert "1.00/2.00" in row  # Mb/s up/down
    assert "2.00" in row and "90%" in row  # round MB, rounds applied
    assert row[-1] == "-"  # an older peer's record names no protocol
    tagged = status_rows([replace(good, protocol="v2-defended-audited")])[0]
    assert tagged[-1] == "v2-defended-audited"  # peers that never average together show it


def test_a_dashboard_that_cannot_listen_says_so(tmp_path: Path):
    from .conftest import run_cli

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        port = busy.getsockname()[1]
        out = run_cli("dashboard", "--join", "nonsense", "--port", str(port), cwd=tmp_path)
        assert out.returncode == 2 and "Traceback" not in out.stderr
        out = run_cli("dashboard", "--join", "x", "--port", "70000", cwd=tmp_path)
        assert out.returncode == 2 and "--port must be a port number" in out.stderr
    finally:
        busy.close()


# --- in a real browser ---------------------------------------------------------------------------


def _chromium() -> tuple[str, str]:
    """Debian's chromium and its driver, installed when missing (as root); else a skip."""
    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (browser and driver) and os.geteuid() == 0 and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        cmd = ["apt-get", "install", "-y", "-qq", "chromium", "chromium-driver"]
        if subprocess.run(cmd, env=env, capture_output=True, timeout=900).returncode != 0:
            subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=600)
            subprocess.run(cmd, env=env, capture_output=True, timeout=900)
        browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (browser and driver):
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install as root)")
    return browser, driver


def _free_port() -> int:
    """A free port below the kernel's ephemeral range: one the kernel hands out (port 0) may go
    to a peer's p2p daemon, which also binds port 0 on every address, before the dashboard
    binds it (CI, 2026-12-05: the page answered "/multistream/1.0.0")."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(max(1024, low - 8192), low), 200):
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def test_the_dashboard_in_a_browser_shows_a_live_two_peer_swarm(tmp_path: Path, prepared: Path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    browser, driver_path = _chromium()
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    argv = [
        sys.executable,
        "-m",
        "atomtrain.cli.main",
        "swarm",
        "--peers=2",
        "--name=dash",
        f"--out-dir={tmp_path / 'runs'}",
        f"--dashboard={port}",
        "--no-sample",
        f"--data.prepared={prepared}",
        "--model.preset=tiny",
        "--data.seq_len=32",
        "--train.steps=100000",  # stopped by the test
        "--train.eval_interval=1000000",
        "--train.checkpoint_interval=1000000",
        "--peer.sync_every=5",
    ]
    log = open(tmp_path / "swarm.log", "w")  # noqa: SIM115 (closed below)
    swarm = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    options.add_argument("--window-size=1280,1000")
    page = None
    try:
        url = f"http://127.0.0.1:{port}/"
        deadline = time.time() + 120
        while time.time() < deadline:  # the launcher serves once peer 0 is up
            assert swarm.poll() is None, (tmp_path / "swarm.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(url, timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        page = webdriver.Chrome(service=Service(driver_path), options=options)
        page.get(url)

        def table() -> dict[str, list[str]]:
            """The table as the page shows it, read in one go (it is redrawn every second)."""
            rows = page.execute_script(
                "return Array.from(document.querySelectorAll('#peers tbody tr'))"
                ".map(r => [r.dataset.peer, ...Array.from(r.cells).map(c => c.textContent)])"
            )
            return {row[0]: row[1:] for row in rows}

        def steps() -> dict[str, int]:
            return {name: int(cells[2]) for name, cells in table().items()}

        def wait_until(check, timeout_s: float = 120.0):
            end = time.time() + timeout_s
            while time.time() < end:
                assert swarm.poll() is None, (tmp_path / "swarm.log").read_text()[-3000:]
                value = check()
                if value:
                    return value
                time.sleep(0.5)
            raise AssertionError(f"page never showed it: {page.page_source[:3000]}")

        first = wait_until(lambda: (s := steps()) and len(s) == 2 and min(s.values()) > 0 and s)
        assert all(name.startswith("dash-peer") for name in first)
        later = wait_until(lambda: (s := steps()) and all(s[k] > first[k] for k in first) and s)
        assert later != first  # the numbers change without a reload
        # a round landed, and the table says what it moved
        wait_until(lambda: all(cells[9] != "-" for cells in table().values()))
        wait_until(
            lambda: (
                int(page.find_element(By.ID, "loss-chart").get_attribute("data-points") or 0) >= 4
            )
        )
        legend = page.find_element(By.ID, "legend").text
        assert "dash-peer0" in legend and "dash-peer1" in legend
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        assert page.save_screenshot(str(ARTIFACTS / "dashboard.png"))
    finally:
        if page is not None:
            page.quit()
        swarm.send_signal(signal.SIGINT)  # Ctrl-C: the launcher stops its peers
        try:
            swarm.wait(timeout=120)
        except subprocess.TimeoutExpired:
            swarm.kill()
        log.close()
