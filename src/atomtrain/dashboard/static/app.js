// The dashboard page: a snapshot a second from /events (server-sent events), drawn as a table
// and a loss chart on a canvas. No libraries: the page works with no internet.
"use strict";

const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];
const mbps = (bytesPerS) => (bytesPerS * 8 / 1e6).toFixed(2);
const secs = (s) => (s === null || s === undefined) ? "never" : s.toFixed(1) + " s";

function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function drawTable(snap) {
  const body = document.querySelector("#peers tbody");
  body.replaceChildren();
  snap.peers.forEach((p) => {
    const tr = document.createElement("tr");
    tr.dataset.peer = p.name;
    if (!p.live) tr.className = "gone";
    const rejected = p.rejected_by.length ? p.rejected_by.join(", ") : "-";
    [
      cell(p.name + (p.live ? "" : " (gone)")),
      cell(String(p.round)),
      cell(String(p.step)),
      cell(p.loss.toFixed(3)),
      cell(p.tokens_per_s.toFixed(0)),
      cell(mbps(p.sent_bps)),
      cell(mbps(p.received_bps)),
      cell(p.round_s ? p.round_s.toFixed(1) + " s" : "-"),
      cell(p.round_s ? p.matchmaking_s.toFixed(1) + " s" : "-"),
      cell(p.round_bytes ? (p.round_bytes / 1e6).toFixed(2) : "-"),
      cell(p.round_s || p.failed_rounds ? Math.round(p.success_share * 100) + "%" : "-"),
      cell(p.sync_every ? String(p.sync_every) : "-"),
      cell(secs(p.since_sync_s)),
      cell(rejected, p.rejected_by.length ? "bad" : ""),
    ].forEach((td) => tr.appendChild(td));
    body.appendChild(tr);
  });
}

function drawChart(snap) {
  const canvas = document.getElementById("loss-chart");
  const ctx = canvas.getContext("2d");
  const W = canvas.width, H = canvas.height, L = 56, R = 16, T = 14, B = 36;
  ctx.clearRect(0, 0, W, H);
  const series = snap.peers.map((p, i) => ({
    name: p.name, color: COLORS[i % COLORS.length], points: snap.history[p.key] || [],
  })).filter((s) => s.points.length);
  const all = series.flatMap((s) => s.points);
  canvas.dataset.points = String(all.length);
  ctx.strokeStyle = "#c9d0dc";
  ctx.strokeRect(L, T, W - L - R, H - T - B);
  if (!all.length) return;
  const steps = all.map((p) => p[1]), losses = all.map((p) => p[2]).filter(Number.isFinite);
  const x0 = Math.min(...steps), x1 = Math.max(...steps, x0 + 1);
  let y0 = Math.min(...losses), y1 = Math.max(...losses);
  if (y1 - y0 < 1e-6) { y0 -= 0.5; y1 += 0.5; }
  const X = (s) => L + (s - x0) / (x1 - x0) * (W - L - R);
  const Y = (v) => T + (y1 - v) / (y1 - y0) * (H - T - B);
  ctx.fillStyle = "#42506b";
  ctx.font = "12px system-ui, sans-serif";
  for (let k = 0; k <= 4; k++) {
    const v = y0 + (y1 - y0) * k / 4, s = Math.round(x0 + (x1 - x0) * k / 4);
    ctx.fillText(v.toFixed(2), 6, Y(v) + 4);
    ctx.fillText(String(s), X(s) - 10, H - B + 16);
  }
  ctx.fillText("step", W / 2, H - 4);
  series.forEach((s) => {
    ctx.strokeStyle = s.color;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    s.points.forEach((p, j) => (j ? ctx.lineTo(X(p[1]), Y(p[2])) : ctx.moveTo(X(p[1]), Y(p[2]))));
    ctx.stroke();
  });
  const legend = document.getElementById("legend");
  legend.replaceChildren(...series.map((s) => {
    const span = document.createElement("span");
    span.innerHTML = `<i style="background:${s.color}"></i>`;
    span.appendChild(document.createTextNode(s.name));
    return span;
  }));
}

function show(snap) {
  document.getElementById("swarm-name").textContent = snap.swarm;
  document.getElementById("live-peers").textContent = snap.totals.live_peers;
  document.getElementById("total-tokens").textContent = snap.totals.tokens_per_s.toFixed(0);
  document.getElementById("total-up").textContent = mbps(snap.totals.sent_bps);
  document.getElementById("total-down").textContent = mbps(snap.totals.received_bps);
  document.getElementById("updated").textContent =
    snap.read_at ? "read " + new Date(snap.read_at * 1000).toLocaleTimeString() : "waiting for the swarm…";
  const error = document.getElementById("error");
  error.hidden = !snap.error;
  error.textContent = snap.error || "";
  drawTable(snap);
  drawChart(snap);
}

const events = new EventSource("/events");
events.onmessage = (e) => show(JSON.parse(e.data));
events.onerror = () => {
  const error = document.getElementById("error");
  error.hidden = false;
  error.textContent = "lost the dashboard server; retrying…";
};
