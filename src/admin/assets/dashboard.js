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

// Which release covers each lane: a running, held, paused or promoted one
// first (it holds the lane), else a rolled-back one — whose lane is revoked,
// as the gateway computes it (a lane another release holds is not revoked).
const HOLDS = new Set(["progressing", "held", "paused", "promoted"]);
function coverage(list) {
  const active = {}, rolled = {};
  for (const r of (list && list.releases) || []) {
    if (HOLDS.has(r.state)) active[r.lane] = r;
    else if (r.state === "rolled_back") rolled[r.lane] = r;
  }
  const cover = Object.assign({}, rolled, active);
  const revoked = new Set(Object.keys(rolled).filter((l) => !(l in active)));
  return { cover, revoked };
}

// A lane with no node left and no request in the "now" window is stale:
// not shown (its counters stay in /stats and /metrics).
function lanesWithNodes(doc) {
  const s = new Set();
  for (const svc of (doc && doc.services) || []) for (const n of svc.nodes) s.add(n.lane);
  return s;
}

const OUTCOME_CLASS = { pass: "pass", step: "pass", promote: "pass", fail: "fail", rollback: "fail", error: "fail" };

function renderStats(st, nodesDoc, releases) {
  const withNodes = lanesWithNodes(nodesDoc);
  const { cover, revoked } = coverage(releases);
  const canary = document.querySelector("#canary tbody");
  const canaryLive = st.canary.filter((c) => withNodes.has(c.lane) || ((c.gray || {}).requests > 0));
  fill(canary, canaryLive.map((c) => {
    const g = c.gray || {}, f = c.formal || {};
    const okText = (check) => ({ pass: "ok", fail: "breach", inconclusive: "inconclusive" })[check] || "no data";
    const rel = cover[c.lane];
    const attrs = { "data-lane": c.lane };
    if (revoked.has(c.lane)) attrs.class = "revoked";
    if (rel) {
      // A lane under a release: the checks of the last 60 s are judged
      // with the release's own thresholds (the server's), and the verdict
      // is the release's own latest decision.
      const last = rel.last || {};
      const outcome = last.outcome || "no decision yet";
      const judged = "release " + rel.name + " (" + rel.state + ")" +
        (c.release ? ": ±" + c.max_error_delta_pp + " pp, ×" + c.max_p99_ratio + " p99" : "") +
        (last.reason ? " — " + last.reason : "");
      attrs["data-release"] = rel.name;
      return el("tr", attrs,
        el("td", {}, c.lane), el("td", {}, pct(g.error_rate)), el("td", {}, pct(f.error_rate)),
        el("td", {}, ms(g.p99_ms)), el("td", {}, ms(f.p99_ms)),
        el("td", { class: "error-check" }, okText(c.errors)), el("td", { class: "latency-check" }, okText(c.latency)),
        el("td", { class: "verdict " + (OUTCOME_CLASS[outcome] || "nodata"), title: last.reason || "" }, outcome),
        el("td", { class: "judged-by" }, judged));
    }
    const cls = c.verdict === "pass" ? "pass" : c.verdict === "fail" ? "fail" : "nodata";
    return el("tr", attrs,
      el("td", {}, c.lane), el("td", {}, pct(g.error_rate)), el("td", {}, pct(f.error_rate)),
      el("td", {}, ms(g.p99_ms)), el("td", {}, ms(f.p99_ms)),
      el("td", { class: "error-check" }, okText(c.errors)), el("td", { class: "latency-check" }, okText(c.latency)),
      el("td", { class: "verdict " + cls, title: c.reason || "" }, c.verdict),
      el("td", { class: "judged-by muted" }, "defaults, last 60 s"));
  }));
  const lanes = st.lanes.filter((l) => withNodes.has(l.name) || ((l.now || {}).requests > 0));
  fill(document.querySelector("#lanes tbody"), lanes.map((l) => {
    const n = l.now || {};
    const rel = cover[l.name];
    const isRevoked = revoked.has(l.name);
    const relText = !rel ? "" : isRevoked ? "revoked (release " + rel.name + " rolled back)"
      : rel.name + ": " + rel.state + (rel.state === "promoted" ? "" : " " + num(rel.weight, 1) + " %");
    return el("tr", isRevoked ? { "data-lane": l.name, class: "revoked" } : { "data-lane": l.name },
      el("td", {}, el("i", { style: "display:inline-block;width:10px;height:10px;margin-right:6px;background:" + colorOf(l.name) }), l.name),
      el("td", { class: "rps" }, num(n.rps, 2)), el("td", { class: "error-rate" }, pct(n.error_rate)),
      el("td", { class: "p99" }, ms(n.p99_ms)), el("td", { class: "total" }, l.total_requests),
      el("td", { class: "release" + (isRevoked ? " fail" : "") }, relText));
  }));
  drawChart(lanes);
  window.__nodeStats = Object.fromEntries(st.nodes.map((n) => [n.name, n.now || {}]));
  window.__nodeClasses = Object.fromEntries(st.nodes.map((n) => [n.name, n.total_by_class || {}]));
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
  // Events of the last 5 minutes: a release's steps, pauses, promotion,
  // rollback, finish, and the last reload, as dashed lines and a list.
  const events = (window.__releaseEvents || []).concat(window.__reloadEvents || [])
    .filter((e) => now - e.t <= span && now - e.t >= -5).sort((a, b) => a.t - b.t);
  ctx.lineWidth = 1; ctx.setLineDash([4, 3]);
  for (const e of events) {
    const x = pad + (W - pad - 5) * (1 - Math.max(0, now - e.t) / span);
    ctx.strokeStyle = e.kind === "rollback" ? "#c0392b" : e.kind === "reload" ? "#8a90a0" : "#2c7be5";
    ctx.beginPath(); ctx.moveTo(x, pad); ctx.lineTo(x, H - pad); ctx.stroke();
  }
  ctx.setLineDash([]);
  document.getElementById("chart-events").replaceChildren(...events.map((e) =>
    el("li", { "data-kind": e.kind }, new Date(e.t * 1000).toLocaleTimeString() + " " + e.label)));
  ctx.lineWidth = 1;
}

function renderNodes(doc) {
  const stats = window.__nodeStats || {};
  const classes = window.__nodeClasses || {};
  const rows = [];
  for (const s of doc.services) {
    for (const n of s.nodes) {
      const st = stats[n.name] || {};
      const byClass = Object.entries(classes[n.name] || {}).map(([k, v]) => k + " " + v).join(", ");
      rows.push(el("tr", { "data-node": n.name, "data-service": s.name },
        el("td", {}, s.name), el("td", {}, n.name), el("td", {}, n.addr), el("td", {}, n.lane),
        el("td", {}, n.drain ? n.weight + " (draining)" : n.weight),
        el("td", { class: "health " + n.health }, n.health),
        el("td", { class: "in-flight" }, n.in_flight), el("td", { class: "requests" }, n.requests),
        el("td", { class: "errors" }, n.errors), el("td", { class: "by-class" }, byClass || "–"),
        el("td", {}, num(st.rps, 2)),
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

// The fleet (a store that keeps one: /status says `fleet`): every gateway
// and whether all run the same revision.
function renderFleet(f, source) {
  const sec = document.getElementById("fleet-section");
  sec.hidden = false;
  const sum = document.getElementById("fleet-summary");
  if (f.error) {
    sum.textContent = source + ": " + f.error;
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

// Releases: a row each with the operator's actions valid in its state, and
// the newest release's decisions as a timeline (each with the values behind
// it).
const ACTIONS = {
  progressing: ["pause", "promote", "abort"],
  held: ["pause", "promote", "abort"],
  paused: ["resume", "promote", "abort"],
  promoted: ["finish"],
  rolled_back: ["finish"],
};
const CONFIRM = {
  abort: (n) => "Abort release " + n + "? Its lane is rolled back: every request goes formal.",
  finish: (n) => "Finish release " + n + "? It stops holding its routes and lane.",
};
// The outcome of the last action per release, kept across refreshes.
const actionMsgs = {};
const busy = new Set();

function renderReleaseRow(r) {
  const last = r.last || {};
  const msg = actionMsgs[r.name] || {};
  const buttons = (ACTIONS[r.state] || []).map((a) =>
    el("button", busy.has(r.name) ? { type: "button", "data-action": a, class: "act " + a, disabled: "" }
      : { type: "button", "data-action": a, class: "act " + a }, a));
  return el("tr", { "data-release": r.name, "data-state": r.state, class: r.state },
    el("td", {}, r.name), el("td", {}, r.lane), el("td", { class: "state", title: r.held || "" }, r.state),
    // The API's `step`: the index in the spec's `steps`, from 0.
    el("td", { class: "step" }, r.step + " (of " + r.steps + ", from 0)"), el("td", {}, num(r.weight, 1) + " %"),
    el("td", {}, r.failures), el("td", { class: "last" }, r.held ? "held: " + r.held
      : (last.outcome || "–") + (last.reason ? ": " + last.reason : "")),
    el("td", { class: "actions" }, ...buttons,
      el("span", { class: "action-msg " + (msg.cls || ""), role: "status" }, msg.text || "")));
}

// Decisions that move a release (not the judged windows): chart events.
const EVENT_OUTCOMES = new Set(["step", "promote", "rollback", "pause", "resume", "finish"]);

async function renderReleases(list) {
  fill(document.querySelector("#releases tbody"), list.releases.map(renderReleaseRow));
  const tl = document.getElementById("release-timeline");
  if (!list.releases.length) { tl.replaceChildren(); window.__releaseEvents = []; return; }
  const newest = list.releases[list.releases.length - 1];
  const full = await getJSON("releases/" + encodeURIComponent(newest.name));
  // The newest release's moves, marked on the request chart.
  window.__releaseEvents = full.analyses.filter((a) => EVENT_OUTCOMES.has(a.outcome)).map((a) => ({
    t: a.at / 1000, kind: a.outcome,
    label: newest.name + " " + a.outcome + (a.outcome === "step" ? " " + a.step + " (" + num(a.weight, 1) + " %)" : ""),
  }));
  tl.replaceChildren(...full.analyses.slice(-20).reverse().map((a) => el("li", { class: a.outcome },
    new Date(a.at).toLocaleTimeString() + " step " + a.step + " (" + num(a.weight, 1) + " %) " + a.outcome +
    (a.gray.requests ? " — gray " + a.gray.requests + " req, " + num(a.gray.error_rate_pct, 2) + " % err, p99 " + ms(a.gray.p99_ms) +
      "; formal " + a.formal.requests + " req, " + num(a.formal.error_rate_pct, 2) + " % err, p99 " + ms(a.formal.p99_ms) : "") +
    (a.reason ? " — " + a.reason : ""))));
}

// POST /releases/NAME/ACTION with the page's admin credentials (the same
// origin as the GETs: a Basic password the browser holds for the origin).
// A refusal (409, 400, …) is shown in the release's row with the server's
// words, and stays there until the next action on that release.
async function releaseAction(name, action) {
  if (CONFIRM[action] && !window.confirm(CONFIRM[action](name))) return;
  busy.add(name);
  actionMsgs[name] = { text: action + "…", cls: "muted" };
  try {
    const r = await fetch(location.origin + "/releases/" + encodeURIComponent(name) + "/" + action,
      { method: "POST", cache: "no-store", credentials: "same-origin" });
    const text = (await r.text()).trim();
    actionMsgs[name] = r.ok ? { text: action + ": done", cls: "pass" }
      : { text: action + " refused (" + r.status + "): " + text, cls: "fail" };
  } catch (e) {
    actionMsgs[name] = { text: action + " failed: " + e.message, cls: "fail" };
  } finally {
    busy.delete(name);
  }
  await refresh();
}
window.releaseAction = releaseAction;

document.querySelector("#releases tbody").addEventListener("click", (ev) => {
  const b = ev.target.closest("button[data-action]");
  const row = b && b.closest("tr[data-release]");
  if (row && !b.disabled) releaseAction(row.dataset.release, b.dataset.action);
});

async function refresh() {
  try {
    const [status, stats, nodes, cfg, releases] = await Promise.all([
      getJSON("status"), getJSON("stats"), getJSON("nodes"), getJSON("config"), getJSON("releases")]);
    await renderReleases(releases);
    window.__reloadEvents = status.last_reload_result === "applied" && status.last_reload_at
      ? [{ t: status.last_reload_at, kind: "reload", label: "reload (generation " + status.generation + ")" }] : [];
    renderStatus(status);
    renderStats(stats, nodes, releases);
    renderNodes(nodes);
    renderConfig(cfg);
    if (status.fleet) {
      renderFleet(await getJSON("fleet").catch((e) => ({ error: e.message })), status.source);
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
