// Kura console: polls the operator summary (/v1/kv/summary) twice a second and draws it; a chat
// playground beside it. No library, nothing fetched from anywhere but this server.
"use strict";

window.__errors = [];
window.addEventListener("error", (e) => window.__errors.push(String(e.message || e)));
window.addEventListener("unhandledrejection", (e) => window.__errors.push(String(e.reason)));

const POLL_MS = 500;
const KEEP_MS = 5 * 60 * 1000;
const $ = (id) => document.getElementById(id);
let key = sessionStorage.getItem("kura-key") || "";
let samples = [];
window.__updates = 0;

function headers(extra) {
  const h = Object.assign({}, extra || {});
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

// Writes to the page only what changed: a write costs the browser a layout and a paint.
function text(id, value) {
  const el = $(id);
  if (el && el.textContent !== value) el.textContent = value;
}

// Fills a table body with rows of cell texts, unless it holds those rows already.
function rows(body, cells) {
  const key = JSON.stringify(cells);
  if (body.dataset.key === key) return;
  body.dataset.key = key;
  body.replaceChildren();
  for (const row of cells) {
    const tr = body.insertRow();
    for (const v of row) tr.insertCell().textContent = v;
  }
}

function num(n) {
  return Number.isFinite(n) ? n.toLocaleString("en-US") : "–";
}

function pct(x) {
  return Number.isFinite(x) ? (100 * x).toFixed(1) + " %" : "–";
}

function seconds(s) {
  if (!Number.isFinite(s)) return "–";
  if (s < 60) return s.toFixed(0) + " s";
  if (s < 3600) return (s / 60).toFixed(1) + " min";
  return (s / 3600).toFixed(1) + " h";
}

function status(cls, words) {
  const el = $("status");
  el.className = "status " + cls;
  el.textContent = words;
}

// The sample `ms` before the newest one (or the oldest there is).
function before(ms) {
  const last = samples[samples.length - 1];
  for (let i = samples.length - 2; i >= 0; i--) {
    if (last.t - samples[i].t >= ms) return samples[i];
  }
  return samples[0];
}

function rate(field, ms) {
  const a = before(ms), b = samples[samples.length - 1];
  const dt = (b.t - a.t) / 1000;
  return dt > 0 ? (b[field] - a[field]) / dt : NaN;
}

function ratio(ms) {
  const a = before(ms), b = samples[samples.length - 1];
  const q = b.query - a.query;
  return q > 0 ? (b.hit - a.hit) / q : NaN;
}

function sample(s) {
  const c = s.counters;
  const tiers = s.tiers || [];
  const sum = (f) => tiers.reduce((acc, t) => acc + (t[f] || 0), 0);
  return {
    t: s.time_ms, query: c.prefix_query_tokens, hit: c.prefix_hit_tokens, evictions: c.evictions,
    loads: sum("loads"), stores: sum("stores"), gen: c.generation_tokens,
    ttft_sum: c.ttft_seconds_sum, ttft_n: c.ttft_count, itl_sum: c.itl_seconds_sum, itl_n: c.itl_count,
    usage: s.pool.usage,
  };
}

function mean(a, b, sumField, nField) {
  const n = b[nField] - a[nField];
  return n > 0 ? (1000 * (b[sumField] - a[sumField])) / n : NaN;
}

function render(s) {
  text("model", s.model);
  const p = s.pool;
  text("pool-total", num(p.blocks_total));
  text("pool-used", num(p.blocks_used));
  text("pool-cached", num(p.blocks_cached));
  text("pool-free", num(p.blocks_free));
  text("pool-reserved", num(p.blocks_reserved));
  text("pool-pinned", num(p.blocks_pinned));
  const bar = $("pool-bar").children;
  const share = (n) => (p.blocks_total > 0 ? (100 * n) / p.blocks_total : 0) + "%";
  for (const [i, n] of [p.blocks_used, p.blocks_cached, Math.max(0, p.blocks_reserved)].entries()) {
    if (bar[i].style.width !== share(n)) bar[i].style.width = share(n);
  }

  const tiers = s.tiers.map((t) => [t.name, num(t.blocks_used) + " / " + num(t.blocks_total) + " blocks, " +
    num(t.loads) + " loads, " + num(t.stores) + " stores"]);
  rows($("tiers").tBodies[0], tiers.length ? tiers : [["none"]]);

  const c = s.counters;
  text("query-tokens", num(c.prefix_query_tokens));
  text("hit-tokens", num(c.prefix_hit_tokens));
  text("requests-finished", num(c.requests_finished));
  text("generation-tokens", num(c.generation_tokens));
  const misses = Object.entries(c.misses).filter(([, n]) => n > 0).map(([r, n]) => r + " " + n);
  text("misses", misses.length ? misses.join(", ") : "none");
  text("running", num(s.requests.running));
  text("waiting", num(s.requests.waiting));
  text("preempted", num(s.requests.preempted_waiting));

  samples.push(sample(s));
  while (samples.length > 2 && samples[samples.length - 1].t - samples[0].t > KEEP_MS) samples.shift();
  text("hit-1m", pct(ratio(60000)));
  text("hit-5m", pct(ratio(KEEP_MS)));
  const r = (f) => { const x = rate(f, 1000); return Number.isFinite(x) ? x.toFixed(1) : "–"; };
  text("evictions-rate", r("evictions"));
  text("loads-rate", r("loads"));
  text("stores-rate", r("stores"));
  const a = before(1000), b = samples[samples.length - 1];
  const ttft = mean(a, b, "ttft_sum", "ttft_n"), itl = mean(a, b, "itl_sum", "itl_n");
  text("ttft", Number.isFinite(ttft) ? ttft.toFixed(1) + " ms" : "–");
  text("itl", Number.isFinite(itl) ? itl.toFixed(1) + " ms" : "–");

  renderPrefixes(s);
  renderContexts(s);
  drawCharts();
}

function renderPrefixes(s) {
  text("prefix-count", "(" + num(s.prefixes.top.length) + " of " + num(s.prefixes.total) + ")");
  rows($("prefixes").tBodies[0], s.prefixes.top.map((x) => [
    num(x.blocks), num(x.tokens), num(x.leaf_hits), num(x.root_hits),
    x.in_use ? "in use" : seconds(x.idle_seconds), x.tier, num(x.pinned_blocks), num(x.used_blocks), x.tenant]));
}

function renderContexts(s) {
  const pins = s.pins;
  text("pins-summary", num(pins.count) + " pinned prefixes holding " + num(pins.blocks) + " blocks (budget " +
       num(pins.budget_blocks) + "); " + num(pins.demoted) + " demoted to lower tiers, " + num(pins.expired) + " expired");
  rows($("contexts").tBodies[0], s.contexts.map((x) => [x.id, num(x.tokens), seconds(x.expires_in_seconds), x.tenant]));
}

function axes(ctx, w, h) {
  ctx.clearRect(0, 0, w, h);
  ctx.strokeStyle = "#dde1e6";
  ctx.strokeRect(0.5, 0.5, w - 1, h - 1);
}

function drawCharts() {
  // Per-interval means of TTFT and ITL, oldest left.
  const lat = $("latency"), lc = lat.getContext("2d");
  axes(lc, lat.width, lat.height);
  const points = [];
  for (let i = 1; i < samples.length; i++) {
    points.push([mean(samples[i - 1], samples[i], "ttft_sum", "ttft_n"), mean(samples[i - 1], samples[i], "itl_sum", "itl_n")]);
  }
  const top = Math.max(1, ...points.flat().filter(Number.isFinite));
  const series = [[0, "#d9534f"], [1, "#3b82c4"]];
  for (const [k, colour] of series) {
    lc.strokeStyle = colour;
    lc.beginPath();
    let started = false;
    points.forEach((pt, i) => {
      if (!Number.isFinite(pt[k])) return;
      const x = (i / Math.max(1, points.length - 1)) * (lat.width - 10) + 5;
      const y = lat.height - 5 - (pt[k] / top) * (lat.height - 20);
      if (started) lc.lineTo(x, y); else lc.moveTo(x, y);
      started = true;
    });
    lc.stroke();
  }
  lc.fillStyle = "#6b7785";
  lc.fillText("TTFT (red), ITL (blue); top " + top.toFixed(1) + " ms", 8, 14);

  // Decode tokens/s against KV usage, one dot per interval.
  const knee = $("knee"), kc = knee.getContext("2d");
  axes(kc, knee.width, knee.height);
  const dots = [];
  for (let i = 1; i < samples.length; i++) {
    const dt = (samples[i].t - samples[i - 1].t) / 1000;
    if (dt > 0) dots.push([samples[i].usage, (samples[i].gen - samples[i - 1].gen) / dt]);
  }
  const ymax = Math.max(1, ...dots.map((d) => d[1]));
  kc.fillStyle = "#3b82c4";
  for (const [u, tps] of dots) {
    kc.fillRect(5 + u * (knee.width - 10), knee.height - 5 - (tps / ymax) * (knee.height - 20), 3, 3);
  }
  kc.fillStyle = "#6b7785";
  kc.fillText("x: KV usage 0–100 %; y: decode tok/s, top " + ymax.toFixed(0), 8, 14);
}

async function poll() {
  try {
    const r = await fetch("/v1/kv/summary", { headers: headers(), cache: "no-store" });
    if (r.status === 401 || r.status === 403) {
      status("bad", r.status === 401 ? "needs the operator key" : "this key may not see the pool");
      $("key-form").hidden = false;
    } else if (!r.ok) {
      status("bad", "summary: HTTP " + r.status);
    } else {
      render(await r.json());
      window.__updates += 1;
      text("updates", String(window.__updates));
      status("ok", "live");
    }
  } catch (e) {
    status("bad", "server unreachable");
  }
  setTimeout(poll, POLL_MS);
}

$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  key = $("key").value;
  sessionStorage.setItem("kura-key", key);
  $("key-form").hidden = true;
});

// ---- Playground ----
const conversation = [];
let model = null;

async function servedModel() {
  if (!model) {
    const r = await fetch("/v1/models", { headers: headers() });
    if (!r.ok) throw new Error("models: HTTP " + r.status);
    model = (await r.json()).data[0].id;
  }
  return model;
}

function addTurn(role, content) {
  const div = document.createElement("div");
  div.className = "turn " + role;
  const body = document.createElement("span");
  body.className = "content";
  body.textContent = content;
  div.appendChild(body);
  $("pg-turns").appendChild(div);
  return div;
}

async function send(userText) {
  const messages = [];
  const system = $("pg-system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  conversation.push({ role: "user", content: userText });
  messages.push(...conversation);
  addTurn("user", userText);
  const turn = addTurn("assistant", "");
  try {
    conversation.push({ role: "assistant", content: await stream(turn, messages) });
  } catch (err) {
    // The server refused it, went away or broke the stream: this turn failed; the conversation goes on
    // without it (its user message, the last one pushed).
    turn.className = "turn error";
    turn.querySelector(".content").textContent = err.message || String(err);
    conversation.pop();
  }
  turn.dataset.done = "1";
}

// Streams the answer to `messages` into `turn` and its figures into the turn's dataset; returns its text.
async function stream(turn, messages) {
  const body = turn.querySelector(".content");
  const started = performance.now();
  let first = null, reply = "", usage = null, chunks = 0;
  const r = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: headers({ "Content-Type": "application/json" }),
    body: JSON.stringify({
      model: await servedModel(), messages, stream: true, stream_options: { include_usage: true },
      temperature: Number($("pg-temp").value), max_tokens: Number($("pg-max").value),
    }),
  });
  if (!r.ok) throw new Error("HTTP " + r.status + ": " + (await r.text()));
  const reader = r.body.getReader();
  const decoder = new TextDecoder();
  let buffered = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffered += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffered.indexOf("\n\n")) >= 0) {
      const event = buffered.slice(0, cut);
      buffered = buffered.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const chunk = JSON.parse(line.slice(6));
        if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
        if (chunk.usage) usage = chunk.usage;
        const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
        if (delta && delta.content) {
          if (first === null) first = performance.now();
          reply += delta.content;
          chunks += 1;
          body.textContent = reply;
        }
      }
    }
  }
  const end = performance.now();
  const details = (usage && usage.prompt_tokens_details) || {};
  const cached = details.cached_tokens || 0;
  const ttft = first === null ? NaN : first - started;
  const decodeS = first === null ? 0 : (end - first) / 1000;
  const tps = usage && decodeS > 0 ? (usage.completion_tokens - 1) / decodeS : NaN;
  const stats = document.createElement("span");
  stats.className = "stats";
  const miss = details.cache_miss ? "; missed: " + details.cache_miss.reason + " at token " + details.cache_miss.at_token : "";
  stats.textContent = "cached " + cached + " of " + (usage ? usage.prompt_tokens : "?") + " prompt tokens; TTFT " +
    (Number.isFinite(ttft) ? ttft.toFixed(0) + " ms" : "–") + "; " + (Number.isFinite(tps) ? tps.toFixed(1) : "–") + " tok/s" + miss;
  turn.appendChild(stats);
  turn.dataset.cached = String(cached);
  turn.dataset.prompt = String(usage ? usage.prompt_tokens : 0);
  turn.dataset.ttftMs = Number.isFinite(ttft) ? ttft.toFixed(1) : "";
  turn.dataset.miss = details.cache_miss ? details.cache_miss.reason : "";
  return reply;
}

$("pg-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const input = $("pg-input");
  const value = input.value.trim();
  if (!value) return;
  input.value = "";
  send(value);
});

$("pg-clear").addEventListener("click", () => {
  conversation.length = 0;
  $("pg-turns").replaceChildren();
});

poll();
