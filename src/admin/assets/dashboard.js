// graygate dashboard: polls the admin API every 2 s and renders it.
"use strict";

const COLORS = ["#1f6feb", "#e5534b", "#2da44e", "#bf8700", "#8250df", "#0a7d8c", "#d4407d"];
const laneColors = {};
function colorOf(lane) {
  if (!(lane in laneColors)) {
    laneColors[lane] = lane === "formal" ? COLORS[0] : COLORS[1 + (Object.keys(laneColors).length % (COLORS.length - 1))];
  }
  return laneColors[lane];
}

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(c == null ? "–" : String(c)));
  return e;
}

const pct = (v) => (v == null ? "–" : (v * 100).toFixed(2) + " %");
const ms = (v) => (v == null ? "–" : v.toFixed(1) + " ms");
const num = (v, d) => (v == null ? "–" : Number(v).toFixed(d));

async function getJSON(path, init) {
  // Absolute URL from the origin: a page opened as http://user:token@host/
  // may not fetch relative URLs (they would carry the credentials).
  const r = await fetch(location.origin + "/" + path, Object.assign({ cache: "no-store", credentials: "same-origin" }, init || {}));
  const text = await r.text();
  if (!r.ok) throw new Error(r.status + " " + text.trim());
  return JSON.parse(text);
}

function fill(tbody, rows) {
  tbody.replaceChildren(...rows);
}

function renderStatus(s) {
  document.getElementById("generation").textContent = s.generation;
  document.getElementById("version").textContent = s.version;
  document.getElementById("uptime").textContent = s.uptime_secs + " s";
  const rr = document.getElementById("reload-result");
  rr.textContent = s.last_reload_result + " (" + s.reloads_applied + " applied, " + s.reloads_rejected + " rejected)";
  rr.className = s.last_reload_result === "rejected" ? "fail" : "";
  const err = document.getElementById("reload-error");
  err.hidden = !s.last_reload_error;
  err.textContent = s.last_reload_error || "";
}

function renderStats(st) {
  const canary = document.querySelector("#canary tbody");
  fill(canary, st.canary.map((c) => {
    const g = c.gray || {}, f = c.formal || {};
    const okText = (check) => ({ pass: "ok", fail: "breach", inconclusive: "inconclusive" })[check] || "no data";
    const cls = c.verdict === "pass" ? "pass" : c.verdict === "fail" ? "fail" : "nodata";
    return el("tr", { "data-lane": c.lane },
      el("td", {}, c.lane), el("td", {}, pct(g.error_rate)), el("td", {}, pct(f.error_rate)),
      el("td", {}, ms(g.p99_ms)), el("td", {}, ms(f.p99_ms)),
      el("td", { class: "error-check" }, okText(c.errors)), el("td", { class: "latency-check" }, okText(c.latency)),
      el("td", { class: "verdict " + cls, title: c.reason || "" }, c.verdict));
  }));
  fill(document.querySelector("#lanes tbody"), st.lanes.map((l) => {
    const n = l.now || {};
    return el("tr", { "data-lane": l.name },
      el("td", {}, el("i", { style: "display:inline-block;width:10px;height:10px;margin-right:6px;background:" + colorOf(l.name) }), l.name),
      el("td", { class: "rps" }, num(n.rps, 2)), el("td", { class: "error-rate" }, pct(n.error_rate)),
      el("td", { class: "p99" }, ms(n.p99_ms)), el("td", { class: "total" }, l.total_requests));
  }));
  drawChart(st.lanes);
  window.__nodeStats = Object.fromEntries(st.nodes.map((n) => [n.name, n.now || {}]));
}

function drawChart(lanes) {
  const c = document.getElementById("chart");
  const ctx = c.getContext("2d");
  const W = c.width, H = c.height, pad = 30;
  ctx.clearRect(0, 0, W, H);
  const now = Date.now() / 1000, span = 300;
  let max = 1;
  for (const l of lanes) for (const p of l.series) max = Math.max(max, p.rps);
  ctx.strokeStyle = "#e3e6ee"; ctx.fillStyle = "#8a90a0"; ctx.font = "11px sans-serif";
  for (let i = 0; i <= 4; i++) {
    const y = H - pad - (H - 2 * pad) * i / 4;
    ctx.beginPath(); ctx.moveTo(pad, y); ctx.lineTo(W - 5, y); ctx.stroke();
    ctx.fillText((max * i / 4).toFixed(1), 2, y + 4);
  }
  ctx.fillText("req/s, last 5 minutes", pad, 12);
  const legend = document.getElementById("legend");
  legend.replaceChildren();
  for (const l of lanes) {
    ctx.strokeStyle = colorOf(l.name); ctx.lineWidth = 2; ctx.beginPath();
    let started = false;
    for (const p of l.series) {
      const x = pad + (W - pad - 5) * (1 - (now - p.t) / span);
      const y = H - pad - (H - 2 * pad) * p.rps / max;
      if (x < pad) continue;
      if (started) ctx.lineTo(x, y); else { ctx.moveTo(x, y); started = true; }
    }
    ctx.stroke();
    legend.append(el("span", {}, el("i", { style: "background:" + colorOf(l.name) }), l.name));
  }
  ctx.lineWidth = 1;
}

function renderNodes(doc) {
  const stats = window.__nodeStats || {};
  const rows = [];
  for (const s of doc.services) {
    for (const n of s.nodes) {
      const st = stats[n.name] || {};
      rows.push(el("tr", { "data-node": n.name, "data-service": s.name },
        el("td", {}, s.name), el("td", {}, n.name), el("td", {}, n.addr), el("td", {}, n.lane),
        el("td", {}, n.drain ? n.weight + " (draining)" : n.weight),
        el("td", { class: "health " + n.health }, n.health),
        el("td", { class: "in-flight" }, n.in_flight), el("td", { class: "requests" }, n.requests),
        el("td", { class: "errors" }, n.errors), el("td", {}, num(st.rps, 2)),
        el("td", {}, pct(st.error_rate)), el("td", {}, ms(st.p99_ms))));
    }
  }
  fill(document.querySelector("#nodes tbody"), rows);
}

function renderConfig(cfg) {
  fill(document.querySelector("#routes tbody"), cfg.routes.map((r) =>
    el("tr", {}, el("td", {}, r.host || "*"), el("td", {}, r.prefix),
      el("td", {}, r.target.service ? "service " + r.target.service : "static " + r.target.static))));
  const lists = Object.entries(cfg.lists || {}).map(([k, v]) => k + " → " + v).join(", ");
  document.getElementById("lists").textContent = lists ? "IP lists: " + lists : "";
  const rules = cfg.rules || {};
  const state = document.getElementById("rules-state");
  if (!rules.source) {
    state.textContent = "(none configured)";
  } else {
    state.textContent = (rules.enabled ? "enabled" : "DISABLED") + " — " + rules.source + " " + (rules.file || "") +
      (rules.deny && rules.deny.length ? " — deny: " + rules.deny.join(", ") : "") + " — fallback " + rules.fallback;
    state.className = rules.enabled ? "muted" : "fail";
  }
  document.getElementById("rules").hidden = !rules.source;
  fill(document.querySelector("#rules tbody"), (rules.rules || []).map((r, i) =>
    el("tr", { "data-rule": r.name }, el("td", {}, i + 1), el("td", {}, r.name), el("td", {}, r.lane),
      el("td", { class: "percentage" }, r.percentage == null ? "–" : r.percentage + " %"))));
  const src = cfg.script;
  document.getElementById("script-path").textContent = src ? "lane script: " + src.path : "no lane script (everything formal)";
  let text = src ? src.source : "";
  if (src) for (const m of src.modules) text += "\n-- module " + m.name + " (" + m.path + ")\n" + m.source;
  document.getElementById("script").textContent = text;
}

// The fleet (etcd source only): every gateway and whether all run the same
// revision.
function renderFleet(f) {
  const sec = document.getElementById("fleet-section");
  sec.hidden = false;
  const sum = document.getElementById("fleet-summary");
  if (f.error) {
    sum.textContent = "etcd: " + f.error;
    sum.className = "fail";
    return;
  }
  sum.textContent = f.same_revision ? "all " + f.gateways.length + " gateways on revision " + (f.revisions[0] ?? "–")
    : "gateways on different revisions: " + f.revisions.join(", ");
  sum.className = f.same_revision ? "pass" : "fail";
  fill(document.querySelector("#fleet tbody"), f.gateways.map((g) => el("tr", { "data-gateway": g.id },
    el("td", {}, g.id), el("td", { class: "revision" }, g.revision), el("td", {}, (g.config_hash || "").slice(0, 12)),
    el("td", {}, g.source_state), el("td", {}, g.generation), el("td", {}, g.version), el("td", {}, g.uptime_secs + " s"),
    el("td", { class: g.last_error || g.store_error ? "fail" : "" }, g.last_error || g.store_error || "none"))));
}

// Releases: a row each, and the newest release's decisions as a timeline
// (each with the values behind it).
async function renderReleases(list) {
  fill(document.querySelector("#releases tbody"), list.releases.map((r) => {
    const last = r.last || {};
    return el("tr", { "data-release": r.name, class: r.state },
      el("td", {}, r.name), el("td", {}, r.lane), el("td", { class: "state", title: r.held || "" }, r.state),
      // The API's `step`: the index in the spec's `steps`, from 0.
      el("td", { class: "step" }, r.step + " (of " + r.steps + ", from 0)"), el("td", {}, num(r.weight, 1) + " %"),
      el("td", {}, r.failures), el("td", { class: "last" }, r.held ? "held: " + r.held
        : (last.outcome || "–") + (last.reason ? ": " + last.reason : "")));
  }));
  const tl = document.getElementById("release-timeline");
  if (!list.releases.length) { tl.replaceChildren(); return; }
  const newest = list.releases[list.releases.length - 1];
  const full = await getJSON("releases/" + encodeURIComponent(newest.name));
  tl.replaceChildren(...full.analyses.slice(-20).reverse().map((a) => el("li", { class: a.outcome },
    new Date(a.at).toLocaleTimeString() + " step " + a.step + " (" + num(a.weight, 1) + " %) " + a.outcome +
    (a.gray.requests ? " — gray " + a.gray.requests + " req, " + num(a.gray.error_rate_pct, 2) + " % err, p99 " + ms(a.gray.p99_ms) +
      "; formal " + a.formal.requests + " req, " + num(a.formal.error_rate_pct, 2) + " % err, p99 " + ms(a.formal.p99_ms) : "") +
    (a.reason ? " — " + a.reason : ""))));
}

async function refresh() {
  try {
    const [status, stats, nodes, cfg, releases] = await Promise.all([
      getJSON("status"), getJSON("stats"), getJSON("nodes"), getJSON("config"), getJSON("releases")]);
    await renderReleases(releases);
    renderStatus(status);
    renderStats(stats);
    renderNodes(nodes);
    renderConfig(cfg);
    if (status.source === "etcd") {
      renderFleet(await getJSON("fleet").catch((e) => ({ error: e.message })));
    }
    const u = document.getElementById("updated");
    u.textContent = "updated " + new Date().toLocaleTimeString();
    u.className = "muted";
  } catch (e) {
    const u = document.getElementById("updated");
    u.textContent = "refresh failed: " + e.message;
    u.className = "error";
  }
}

function lines(text, sep) {
  const out = {};
  for (const line of text.split("\n")) {
    const i = line.indexOf(sep);
    if (i > 0) out[line.slice(0, i).trim()] = line.slice(i + 1).trim();
  }
  return out;
}

document.getElementById("explain-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const f = ev.target.elements;
  const q = {
    method: f.method.value || "GET", path: f.path.value || "/",
    headers: lines(f.headers.value, ":"), cookies: lines(f.cookies.value, "="),
  };
  if (f.host.value) q.host = f.host.value;
  if (f.query.value) q.query = f.query.value;
  if (f.ip.value) q.ip = f.ip.value;
  const out = document.getElementById("explain-result");
  const raw = document.getElementById("explain-raw");
  try {
    const r = await getJSON("explain", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(q) });
    const fields = [["lane", r.lane], ["decided_by", r.decided_by], ["rule", r.rule], ["route", r.route && r.route.prefix],
      ["chosen", r.chosen], ["served_lane", r.served_lane], ["fallback", r.fallback],
      ["candidates", (r.candidates || []).map((c) => c.name).join(", ")], ["error", r.error || r.detail]];
    out.replaceChildren(...fields.flatMap(([k, v]) => [el("dt", {}, k), el("dd", { "data-field": k }, v == null || v === "" ? "–" : v)]));
    raw.textContent = JSON.stringify(r, null, 2);
  } catch (e) {
    out.replaceChildren(el("dt", {}, "error"), el("dd", { "data-field": "error" }, e.message));
    raw.textContent = "";
  }
});

refresh();
setInterval(refresh, 2000);
