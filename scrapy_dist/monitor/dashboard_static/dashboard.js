// scrapy-dist dashboard: polls /api/status and /api/history, draws with Chart.js, acts with the token.
"use strict";
const REFRESH_MS = 3000;
const fmt = (n) => (n === null || n === undefined) ? "?" : Number(n).toLocaleString();
const text = (s) => document.createTextNode(s === null || s === undefined ? "" : String(s));

function line(id, datasets) {
  return new Chart(document.getElementById(id), {
    type: "line",
    data: { labels: [], datasets: datasets.map((label) => ({ label, data: [], pointRadius: 0, tension: 0.2 })) },
    options: { animation: false, responsive: true, scales: { y: { beginAtZero: true } } },
  });
}
const charts = {
  pages: line("pages", ["crawl-wide"]),
  frontier: line("frontier", ["queued", "in flight", "delayed"]),
  errors: line("errors", ["errors/min"]),
};
window.dashboardCharts = charts; // for tests: what is drawn

function table(id, head, rows) {
  const t = document.getElementById(id);
  t.replaceChildren();
  const tr = t.insertRow();
  head.forEach((h) => { const th = document.createElement("th"); th.appendChild(text(h)); tr.appendChild(th); });
  rows.forEach((r) => {
    const row = t.insertRow();
    r.forEach((cell) => {
      const td = row.insertCell();
      if (cell && typeof cell === "object") { td.className = cell.cls; td.appendChild(text(cell.v)); }
      else td.appendChild(text(cell));
    });
  });
}

function clock(t) { return new Date(t * 1000).toLocaleTimeString(); }

// the JSON of an endpoint; while Redis is away the server answers 503 with {"error": ...}
async function getJSON(url) {
  const reply = await fetch(url);
  const body = await reply.json();
  if (!reply.ok) throw new Error(body.error || `HTTP ${reply.status}`);
  return body;
}

async function refreshStatus() {
  const s = await getJSON("/api/status");
  document.getElementById("state").textContent = `(${s.state}${s.control.paused ? ", paused" : ""})`;
  const f = document.getElementById("figures");
  f.replaceChildren();
  [["queued", s.frontier.queued], ["in flight", s.frontier.inflight], ["delayed", s.frontier.delayed],
   ["seeds waiting", s.seeds.waiting], ["dead letters", s.deadletter], ["pages/min", s.rates.pages_per_min],
   ["error rate", s.rates.error_rate === null ? "–" : (100 * s.rates.error_rate).toFixed(1) + " %"],
   ["filter items", s.filter ? s.filter.items : null]].forEach(([k, v]) => {
    const span = document.createElement("span");
    const b = document.createElement("b"); b.appendChild(text(typeof v === "number" ? fmt(v) : v));
    span.appendChild(b); span.appendChild(text(" " + k)); f.appendChild(span);
  });
  table("workers", ["worker", "state", "last seen", "pages", "items", "leases"], s.workers.map((w) => [
    w.id, { v: w.state, cls: w.state }, `${w.seen_ago}s ago`, fmt(w.pages), fmt(w.items), fmt(w.leases)]));
  table("domains", ["domain", "backlog", "in flight", "delay", "concurrency"], s.domains.map((d) => [
    d.domain, fmt(d.backlog), fmt(d.in_flight), d.delay, d.concurrency]));
  table("dead", ["reason", "count (newest 200)"], Object.entries(s.dead_reasons));
  table("reasons", ["error reason (monitor window)", "count"], Object.entries(s.errors.reasons || {}));
}

async function refreshHistory() {
  const h = await getJSON("/api/history");
  const labels = h.times.map(clock);
  const pages = charts.pages;
  pages.data.labels = labels;
  const workers = Object.keys(h.workers).sort();
  pages.data.datasets = [{ label: "crawl-wide", data: h.pages_per_min, pointRadius: 0 }].concat(
    workers.map((w) => ({ label: w, data: h.workers[w], pointRadius: 0, borderDash: [4, 3] })));
  pages.update();
  charts.frontier.data.labels = labels;
  [h.queued, h.inflight, h.delayed].forEach((d, i) => { charts.frontier.data.datasets[i].data = d; });
  charts.frontier.update();
  charts.errors.data.labels = labels;
  charts.errors.data.datasets[0].data = h.errors_per_min;
  charts.errors.update();
}

async function refresh() {
  const msg = document.getElementById("message");
  try {
    await Promise.all([refreshStatus(), refreshHistory()]);
    if (msg.textContent.startsWith("refresh failed")) msg.textContent = "";
  } catch (e) { msg.textContent = "refresh failed: " + e.message; }
}

const tokenBox = document.getElementById("token");
tokenBox.value = sessionStorage.getItem("scrapy-dist-token") || "";
tokenBox.addEventListener("change", () => sessionStorage.setItem("scrapy-dist-token", tokenBox.value));

async function act(action) {
  const reply = await fetch("/api/" + action, { method: "POST", headers: { "X-Dashboard-Token": tokenBox.value } });
  const msg = document.getElementById("message");
  const body = (reply.headers.get("Content-Type") || "").startsWith("application/json") ? await reply.json() : {};
  msg.textContent = reply.ok ? `${action}: ${body.done}` : `${action} refused (${body.error || reply.status})`;
  refresh();
}
["pause", "resume", "requeue"].forEach((a) => document.getElementById(a).addEventListener("click", () => act(a)));

refresh();
setInterval(refresh, REFRESH_MS);
