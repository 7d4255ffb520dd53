"use strict";
// The live page: polls /api/status (docs/STATUS.md) every second and draws it;
// ages tick between polls. No library, nothing fetched from elsewhere.

const $ = (id) => document.getElementById(id);
const POLL_MS = 1000;
let job = new URLSearchParams(location.search).get("job") || "";
let doc = null;
let receivedAt = 0;
let selected = null;
let timer = null;

const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));

function secs(ms) {
  if (ms < 0) ms = 0;
  if (ms < 60000) return (ms / 1000).toFixed(1) + " s";
  const s = Math.floor(ms / 1000);
  if (s < 3600) return Math.floor(s / 60) + " min " + (s % 60) + " s";
  return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
}

// An age that ticks: `ms` as of the document, growing with the time since it came.
const age = (ms) => `<span class="age" data-ms="${ms}">${secs(ms)}</span>`;
// Time left, as of the document, shrinking likewise.
const countdown = (ms) => `<span class="countdown" data-ms="${ms}">${secs(ms)}</span>`;

function tick() {
  const since = performance.now() - receivedAt;
  for (const el of document.querySelectorAll(".age")) el.textContent = secs(Number(el.dataset.ms) + since);
  for (const el of document.querySelectorAll(".countdown")) el.textContent = secs(Number(el.dataset.ms) - since);
  if (doc) {
    const live = $("live");
    if (since > 5000) {
      live.className = "live down";
      live.textContent = "no update for " + secs(since);
    }
  }
}

// Ranges [[a, b], ...] as "a-b,c": the first MAX_RUNS of them, so that thousands of
// ranks in scattered states stay a line or two and the grid stays in view.
const MAX_RUNS = 12;
function ranges(list) {
  const shown = list.slice(0, MAX_RUNS).map(([a, b]) => (a === b ? `${a}` : `${a}-${b}`)).join(",");
  return list.length > MAX_RUNS ? `${shown},… (${list.length - MAX_RUNS} more runs)` : shown;
}
function rangesOf(sorted) {
  const out = [];
  for (const r of sorted) {
    const last = out[out.length - 1];
    if (last && last[1] + 1 === r) last[1] = r;
    else out.push([r, r]);
  }
  return out;
}
function setText(set) {
  if (!set || set.count === 0) return "none";
  const listed = set.ranges.reduce((n, [a, b]) => n + b - a + 1, 0);
  const more = set.count > listed ? ` and ${set.count - listed} more` : "";
  return (set.count === 1 ? "rank " : "ranks ") + ranges(set.ranges) + more;
}
const ranksText = (sorted) => (sorted.length === 1 ? "rank " : "ranks ") + ranges(rangesOf(sorted));

// A rank's state in words; `html` lets its times tick.
function rankWords(r, html) {
  const g = r.reconnecting;
  if (r.state === "connected" && g) {
    const [ago, due] = html ? [age(g.dropped_ms_ago), countdown(g.lost_in_ms)] : [secs(g.dropped_ms_ago), secs(g.lost_in_ms)];
    return `reconnecting: connection dropped ${ago} ago, lost in ${due} unless it resumes`;
  }
  switch (r.state) {
    case "never_connected": return "never connected";
    case "connected": return "connected";
    case "left": return "left cleanly";
    case "lost": return "lost: " + (r.lost ? r.lost.text : "");
    case "finished": return "finished: " + (r.finished ? r.finished.text : "");
  }
  return r.state;
}

function rankLine(r) {
  let s = `rank ${r.rank} (${rankWords(r, true)}`;
  if (r.host !== undefined) s += `, host ${esc(r.host)}`;
  if (r.pid !== undefined) s += `, pid ${r.pid}`;
  if (r.last_seen_ms_ago !== undefined) s += `, last seen ${age(r.last_seen_ms_ago)} ago`;
  return s + ")";
}

const opWords = { barrier: "barrier", all_gather: "all-gather", broadcast: "broadcast" };
const waitName = (w) => `${opWords[w.op] || w.op} '${esc(w.name)}' (generation ${w.generation})`;

// Ranks each blocked collective (and each torch process group) waits for.
function missingRanks(j) {
  const missing = new Map();
  const add = (rank, why) => { if (!missing.has(rank)) missing.set(rank, why); };
  j.waits.forEach((w) => {
    w.missing.forEach((r) => add(r.rank, waitName(w)));
    w.missing_more.ranges.forEach(([a, b]) => { for (let r = a; r <= b && r - a < 65536; r++) add(r, waitName(w)); });
  });
  if (j.torch) j.torch.process_groups.forEach((g) => g.missing.ranges.forEach(([a, b]) => {
    for (let r = a; r <= b && r - a < 65536; r++) add(r, `address key of process group ${esc(g.prefix)}`);
  }));
  return missing;
}

function category(r) {
  if (r.state === "lost") return "lost";
  if (r.state === "left") return "left";
  if (r.state === "finished") return "finished";
  if (r.state === "never_connected") return "never";
  if (r.reconnecting) return "reconnecting";
  if (r.wait !== undefined) return "waiting";
  if (r.key_wait !== undefined) return "keywait";
  return "idle";
}
const categoryWords = { idle: "connected, not waiting", waiting: "in a barrier or collective", keywait: "waiting for keys", never: "never connected", left: "left cleanly", finished: "finished (worker exited with code 0)", lost: "lost", reconnecting: "reconnecting (connection dropped, may resume)" };

function renderGrid(j) {
  const missing = missingRanks(j);
  const n = j.ranks.length;
  const size = n <= 64 ? 30 : n <= 1024 ? 15 : 9;
  const grid = $("grid");
  grid.style.gridTemplateColumns = `repeat(auto-fill, ${size}px)`;
  grid.style.gridAutoRows = `${size}px`;
  const groups = new Map();
  const cells = j.ranks.map((r) => {
    const cat = category(r);
    const why = missing.get(r.rank);
    const key = why ? "missing" : cat;
    if (!groups.has(key)) groups.set(key, []);
    groups.get(key).push(r.rank);
    const title = `rank ${r.rank}: ${rankWords(r)}` + (r.host !== undefined ? `, host ${r.host}, pid ${r.pid}` : "") +
      (r.wait !== undefined ? ` — in ${j.waits[r.wait].op} '${j.waits[r.wait].name}'` : "") +
      (why ? ` — missing from ${why.replace(/<[^>]*>/g, "")}` : "");
    const label = size >= 30 ? r.rank : "";
    return `<div class="cell ${cat}${why ? " missing" : ""}${selected === r.rank ? " selected" : ""}" data-rank="${r.rank}" title="${esc(title)}">${label}</div>`;
  });
  grid.innerHTML = cells.join("");
  const order = ["missing", "lost", "reconnecting", "never", "waiting", "keywait", "idle", "left", "finished"];
  $("groups").innerHTML = order.filter((k) => groups.has(k)).map((k) => {
    const list = groups.get(k);
    const swatch = k === "missing" ? `<span class="swatch" style="outline:2px solid var(--missing);background:#ffe2b0"></span>` : `<span class="swatch cell ${k}"></span>`;
    const words = k === "missing" ? "missing (others wait for them)" : categoryWords[k];
    return `<span class="group" data-group="${k}">${swatch}${words}: ${ranksText(list)} (${list.length})</span>`;
  }).join("");
  const more = (j.world_size || 0) > n ? ` <span class="muted">(the first ${n} of ${j.world_size} ranks shown)</span>` : "";
  $("groups").innerHTML += more;
  if (selected !== null) showDetail(j, selected);
}

function showDetail(j, rank) {
  const r = j.ranks.find((x) => x.rank === rank);
  const d = $("detail");
  if (!r) { d.hidden = true; return; }
  let text = rankLine(r);
  if (r.role !== undefined) text += `\nrole ${esc(r.role)}`;
  if (r.wait !== undefined) text += `\nwaiting in ${waitName(j.waits[r.wait])} for ${age(j.waits[r.wait].waited_ms)}`;
  if (r.key_wait !== undefined) {
    const k = j.key_waits[r.key_wait];
    text += `\nwaiting ${age(k.waited_ms)} for keys ${k.keys.map(esc).join(", ")}`;
  }
  const why = missingRanks(j).get(rank);
  if (why) text += `\nmissing from ${why}`;
  d.innerHTML = text;
  d.hidden = false;
}

const NAMED_MISSING = 8;

function renderWaits(j) {
  if (j.waits.length === 0) { $("waits").innerHTML = `<p class="muted">Nobody waits in a barrier or collective.</p>`; return; }
  $("waits").innerHTML = j.waits.map((w) => {
    const members = w.members === null ? "?" : w.members;
    const what = w.root !== undefined ? `the root (rank ${w.root}) has not arrived` : "missing";
    // The first few by name, the rest as ranges (the server names up to 64).
    const named = w.missing.slice(0, NAMED_MISSING).map(rankLine);
    const rest = rangesOf(w.missing.slice(NAMED_MISSING).map((r) => r.rank)).concat(w.missing_more.ranges);
    const restCount = Math.max(w.missing.length - NAMED_MISSING, 0) + w.missing_more.count;
    if (restCount > 0) named.push(`and ${restCount} more: ${restCount === 1 ? "rank" : "ranks"} ${ranges(rest)}`);
    return `<div class="wait${w.missing_count > 0 ? " stuck" : ""}"><b>${waitName(w)}</b> for ${age(w.waited_ms)}: ` +
      `${w.arrived} of ${members} arrived; <span class="missing-list">${what} (${w.missing_count}): ${named.join("; ")}</span></div>`;
  }).join("");
}

function renderKeys(j) {
  $("keys-section").hidden = j.key_waits.length === 0;
  if (j.key_waits.length === 0) return;
  const rows = j.key_waits.map((k) => `<tr><td>${k.rank === null ? "unattributed " + esc(k.session_name) : "rank " + k.rank}</td>` +
    `<td>${esc(k.host)}, pid ${k.pid}${k.tcpstore ? " (TCPStore)" : ""}</td><td>${k.op}</td>` +
    `<td>${k.keys.map((x) => `<code>${esc(x)}</code>`).join("<br>")}${k.keys_total > k.keys.length ? `<br>and ${k.keys_total - k.keys.length} more` : ""}` +
    `${k.world_size !== undefined ? ` (world size ${k.world_size})` : ""}</td>` +
    `<td>${k.absent.map((x) => `<code>${esc(x)}</code>`).join("<br>")}</td><td>${age(k.waited_ms)}</td></tr>`);
  const more = j.key_waits_total > j.key_waits.length ? `<p class="muted">and ${j.key_waits_total - j.key_waits.length} more</p>` : "";
  $("keys").innerHTML = `<table><tr><th>who</th><th>process</th><th>op</th><th>keys</th><th>absent</th><th>waiting</th></tr>${rows.join("")}</table>${more}`;
}

function renderTorch(j, generated) {
  const t = j.torch;
  $("torch-section").hidden = !t;
  if (!t) return;
  let html = `<p>${t.tcpstore_connections} TCPStore connection(s); ranks inferred: ${setText(t.attributed)}; ` +
    `init/: ${t.init_arrivals === null ? "no arrivals" : esc(t.init_arrivals) + " process(es) arrived"}</p>`;
  if (t.process_groups.length) {
    html += `<table><tr><th>process group</th><th>address written by</th><th>never written, waited for</th></tr>` +
      t.process_groups.map((g) => `<tr><td><code>${esc(g.prefix)}</code></td><td>${setText(g.written)}</td>` +
        `<td class="missing-list">${g.missing.count ? setText(g.missing) : ""}</td></tr>`).join("") + `</table>`;
  }
  if (t.store_barriers.length) {
    html += `<table><tr><th>store barrier</th><th>counter</th><th>waiting</th><th>missing</th></tr>` +
      t.store_barriers.map((b) => `<tr><td><code>${esc(b.key)}</code></td><td>${esc(b.counter)}</td>` +
        `<td>${b.waiting}${b.world_size !== null ? " of world size " + b.world_size : ""} (${setText(b.arrived)})</td>` +
        `<td class="missing-list">${b.missing ? setText(b.missing) : ""}</td></tr>`).join("") + `</table>`;
  }
  for (const r of t.rendezvous) {
    if (!r.state) { html += `<div class="item">torchrun rendezvous '${esc(r.run_id)}': undecodable (${esc(r.error || "")})</div>`; continue; }
    const s = r.state;
    const beat = (n) => n.last_heartbeat_unix_ms === null ? "no heartbeat" : `last heartbeat ${age(generated - n.last_heartbeat_unix_ms)} ago`;
    const nodes = s.participants.map((n) => `<tr><td>${esc(n.node)}</td><td>${n.rank === undefined ? "" : n.rank}</td><td>${beat(n)}</td></tr>`).join("");
    const waiting = s.wait_list.length ? `<br>waiting for the next round: ${s.wait_list.map((n) => esc(n.node)).join(", ")}` : "";
    html += `<div class="item">torchrun rendezvous '${esc(r.run_id)}': round ${s.round}, ${s.complete ? "complete" : "incomplete"}${s.closed ? ", closed" : ""}, ` +
      `${s.participants.length} participant(s)${waiting}<table><tr><th>node</th><th>rank</th><th>heartbeat</th></tr>${nodes}</table></div>`;
  }
  $("torch").innerHTML = html;
}

function renderLauncher(l) {
  $("launcher-section").hidden = !l;
  if (!l) return;
  const rows = l.workers.map((w) => `<tr><td>${w.rank}</td><td>${w.local_rank}</td><td>${w.pid === null ? "" : w.pid}</td>` +
    `<td>${esc(w.state)}</td><td>${esc(w.text || "")}</td></tr>`).join("");
  $("launcher").innerHTML = `<p>job '${esc(l.job)}' (coordinator job '${esc(l.attempt_job)}'), node ${l.node === null ? "?" : l.node} of ${l.nnodes} ` +
    `on ${esc(l.host)}, attempt ${l.attempt} of ${l.max_restarts + 1}: <b>${esc(l.state)}</b></p>` +
    `<table><tr><th>rank</th><th>local rank</th><th>pid</th><th>state</th><th>outcome</th></tr>${rows}</table>` +
    (l.summary ? `<pre>${esc(l.summary)}</pre>` : "");
}

function renderStacks(s) {
  $("stacks-section").hidden = !s;
  if (!s) return;
  $("stacks").innerHTML = s.groups.map((g) => `<div class="item"><b>${setText(g.ranks)} (${g.ranks.count} of ${g.of})</b>` +
    `<div class="frames">${g.frames.map(esc).join(" ← ")}</div></div>`).join("");
}

function render() {
  const j = doc.job;
  const select = $("job");
  const names = doc.jobs.slice();
  if (j && !names.includes(j.name)) names.unshift(j.name);
  select.innerHTML = names.map((n) => `<option${j && n === j.name ? " selected" : ""}>${esc(n)}</option>`).join("");
  $("coordinator").textContent = "coordinator " + doc.coordinator;
  const live = $("live");
  live.className = "live ok";
  live.textContent = "live, " + new Date(doc.generated_unix_ms).toLocaleTimeString();
  const alerts = [];
  if (!j) alerts.push(job ? `The coordinator holds no job '${esc(job)}'.` : "The coordinator holds no job yet.");
  if (j && j.aborted) alerts.push(`Job aborted${j.aborted.by_rank === null ? "" : " by rank " + j.aborted.by_rank}: ${esc(j.aborted.reason)}`);
  $("alerts").innerHTML = alerts.map((a) => `<div class="alert">${a}</div>`).join("");
  if (j) {
    const s = j.ranks_summary;
    $("summary").innerHTML = `<div class="summary"><span>world size <b>${j.world_size === null ? "?" : j.world_size}</b></span>` +
      `<span>connected <b>${s.connected}</b>${s.reconnecting ? ` (${s.reconnecting} reconnecting)` : ""}</span><span>left <b>${s.left}</b></span><span>lost <b>${s.lost}</b></span>` +
      `${s.finished ? `<span>finished <b>${s.finished}</b></span>` : ""}` +
      `<span>never connected <b>${s.never_connected}</b></span><span>in a collective <b>${s.in_collective}</b></span>` +
      `<span>waiting for keys <b>${s.in_key_wait}</b></span><span class="muted">sessions: ${j.sessions.native} native` +
      `${j.sessions.via_agent ? ` (${j.sessions.via_agent} through node agents)` : ""}, ${j.sessions.tcpstore} TCPStore</span></div>`;
    renderGrid(j);
    renderWaits(j);
    renderKeys(j);
    renderTorch(j, doc.generated_unix_ms);
  } else {
    for (const id of ["summary", "groups", "grid", "waits"]) $(id).innerHTML = "";
    $("keys-section").hidden = true;
    $("torch-section").hidden = true;
  }
  renderLauncher(doc.launcher);
  renderStacks(doc.stacks);
  document.body.dataset.job = j ? j.name : "";
  document.body.dataset.updated = String(doc.generated_unix_ms);
}

async function poll() {
  try {
    const response = await fetch("/api/status" + (job ? "?job=" + encodeURIComponent(job) : ""), { cache: "no-store", credentials: "same-origin" });
    if (response.status === 401) { location.href = "/"; return; }
    if (!response.ok) throw new Error("HTTP " + response.status);
    doc = await response.json();
    receivedAt = performance.now();
    render();
  } catch (e) {
    const live = $("live");
    live.className = "live down";
    live.textContent = "cannot reach the coordinator's page: " + e.message;
  }
  clearTimeout(timer);
  timer = setTimeout(poll, POLL_MS);
}

$("job").addEventListener("change", (e) => {
  job = e.target.value;
  selected = null;
  $("detail").hidden = true;
  history.replaceState(null, "", "?job=" + encodeURIComponent(job));
  clearTimeout(timer);
  poll();
});
$("grid").addEventListener("click", (e) => {
  const cell = e.target.closest(".cell");
  if (!cell || !doc || !doc.job) return;
  selected = Number(cell.dataset.rank);
  renderGrid(doc.job);
});
setInterval(tick, 1000);
poll();
