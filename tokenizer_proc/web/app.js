// The page at `/`: a chat that streams through the engine's own OpenAI endpoint, and a status view
// from its /metrics. Plain JS, no build step, nothing fetched from elsewhere. The API key (asked
// for when the engine answers 401) stays in this tab's sessionStorage; the page never holds one.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY = "mlx-engine-key";
const state = { messages: [], model: null, last: null };

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(KEY);
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

async function api(path, options = {}) {
  const r = await fetch(path, { ...options, headers: headers() });
  if (r.status === 401) {
    $("key-form").hidden = false;
    throw new Error("this engine needs its API key (above)");
  }
  return r;
}

async function loadModel() {
  try {
    const r = await api("/v1/models");
    state.model = (await r.json()).data[0].id;
    $("model").textContent = state.model;
  } catch (e) {
    $("model").textContent = e.message;
  }
}

// --- chat ------------------------------------------------------------------------------------

function escape(text) {
  const map = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" };
  return text.replace(/[&<>"]/g, (c) => map[c]);
}

// Text with ``` fences as code blocks; everything escaped first, so a reply is never markup.
function render(text) {
  return text
    .split("```")
    .map((part, i) =>
      i % 2
        ? "<pre><code>" + escape(part.replace(/^[\w+.-]*\n/, "")) + "</code></pre>"
        : escape(part).replace(/\n/g, "<br>"),
    )
    .join("");
}

function addMessage(role, text) {
  const el = document.createElement("div");
  el.className = "msg " + role;
  el.innerHTML = `<div class="who">${role}</div><div class="body"></div><div class="meta"></div>`;
  el.querySelector(".body").innerHTML = render(text);
  $("messages").appendChild(el);
  el.scrollIntoView({ block: "end" });
  return { el, body: el.querySelector(".body"), meta: el.querySelector(".meta") };
}

function sampling() {
  const out = {
    temperature: Number($("temperature").value),
    top_p: Number($("top_p").value),
    max_tokens: Number($("max_tokens").value),
  };
  const stop = $("stop").value.split(",").map((s) => s.trim()).filter(Boolean);
  if (stop.length) out.stop = stop;
  return out;
}

// Server-sent events from a fetch body: each `data:` line's JSON, until [DONE].
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith("data: ") && line !== "data: [DONE]") yield JSON.parse(line.slice(6));
      }
    }
  }
}

async function send(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text) return;
  $("prompt").value = "";
  state.messages.push({ role: "user", content: text });
  addMessage("user", text);
  const reply = addMessage("assistant", "");
  state.last = reply.el;
  const system = $("system").value.trim();
  const messages = (system ? [{ role: "system", content: system }] : []).concat(state.messages);
  const body = { model: state.model, messages, stream: true, stream_options: { include_usage: true } };
  const t0 = performance.now();
  let first = null, tokens = 0, out = "";
  try {
    const r = await api("/v1/chat/completions", { method: "POST", body: JSON.stringify({ ...body, ...sampling() }) });
    if (!r.ok) throw new Error((await r.json()).error?.message || r.statusText);
    for await (const chunk of events(r)) {
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
      const delta = chunk.choices?.[0]?.delta?.content;
      if (delta) {
        if (first === null) first = performance.now();
        out += delta;
        reply.body.innerHTML = render(out);
      }
    }
    state.messages.push({ role: "assistant", content: out });
    const seconds = (performance.now() - (first ?? t0)) / 1000;
    const rate = tokens > 1 && seconds > 0 ? (tokens - 1) / seconds : 0;
    const ttft = first === null ? "–" : Math.round(first - t0) + " ms";
    reply.meta.textContent = `TTFT ${ttft} · ${tokens} tokens · ${rate.toFixed(1)} tok/s`;
    reply.el.dataset.done = "ok";
  } catch (e) {
    reply.meta.textContent = "error: " + e.message;
    reply.el.dataset.done = "error";
  }
}

// --- status ----------------------------------------------------------------------------------

// Prometheus text: name{labels} value, for every line that is not a comment.
function parseMetrics(text) {
  const out = {};
  for (const line of text.split("\n")) {
    const m = line.match(/^([a-z_:]+)(\{[^}]*\})?\s+(\S+)$/);
    if (m) out[m[1] + (m[2] || "")] = Number(m[3]);
  }
  return out;
}

function histogram(el, metrics, name) {
  const buckets = Object.keys(metrics)
    .filter((k) => k.startsWith(name + "_bucket{"))
    .map((k) => [k.match(/le="([^"]+)"/)[1], metrics[k]]);
  let previous = 0;
  const counts = buckets.map(([le, cumulative]) => {
    const n = cumulative - previous;
    previous = cumulative;
    return [le, n];
  });
  const most = Math.max(1, ...counts.map(([, n]) => n));
  el.replaceChildren(
    ...counts.map(([le, n]) => {
      const row = document.createElement("div");
      row.className = "bar";
      const label = document.createElement("span");
      label.textContent = le === "+Inf" ? "more" : "≤ " + (Number(le) < 1 ? Number(le) * 1000 + " ms" : le + " s");
      const bar = document.createElement("i");
      bar.style.width = (20 * n) / most + "em"; // NOTE: the CSSOM, which the page's CSP allows
      row.append(label, bar, String(n));
      return row;
    }),
  );
}

let previous = null;

async function refresh() {
  if ($("status").hidden) return;
  try {
    const m = parseMetrics(await (await api("/metrics")).text());
    const p = "mlx_engine_";
    $("s-running").textContent = m[p + "requests_running"];
    $("s-waiting").textContent = m[p + "requests_waiting"];
    $("s-flight").textContent = m[p + "requests_in_flight"];
    const total = m[p + "kv_tokens_total"] || 1;
    $("s-kv").textContent = `${m[p + "kv_tokens_used"]} (${((100 * m[p + "kv_tokens_used"]) / total).toFixed(1)}%)`;
    $("s-hits").textContent = (100 * m[p + "prefix_cache_hit_rate"]).toFixed(1) + "%";
    $("s-state").textContent = m[p + "generation_paused"] ? "paused" : "running";
    $("s-received").textContent = m[p + "requests_received_total"];
    const finished = Object.keys(m).filter((k) => k.startsWith(p + "requests_finished_total"));
    $("s-finished").textContent = finished.reduce((sum, k) => sum + m[k], 0);
    const now = performance.now(), generated = m[p + "generation_tokens_total"];
    if (previous) $("s-tps").textContent = (((generated - previous[1]) * 1000) / (now - previous[0])).toFixed(1);
    previous = [now, generated];
    histogram($("h-ttft"), m, p + "time_to_first_token_seconds");
    histogram($("h-itl"), m, p + "inter_token_latency_seconds");
  } catch (e) {
    $("s-running").textContent = e.message;
  }
}

// --- wiring ----------------------------------------------------------------------------------

function show(tab) {
  $("chat").hidden = tab !== "chat";
  $("status").hidden = tab !== "status";
  $("tab-chat").classList.toggle("on", tab === "chat");
  $("tab-status").classList.toggle("on", tab === "status");
  refresh();
}

$("ask").addEventListener("submit", send);
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) send(e);
});
$("clear").addEventListener("click", () => {
  state.messages = [];
  $("messages").innerHTML = "";
});
$("tab-chat").addEventListener("click", () => show("chat"));
$("tab-status").addEventListener("click", () => show("status"));
$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem(KEY, $("key").value);
  $("key").value = "";
  $("key-form").hidden = true;
  loadModel();
});
setInterval(refresh, 1000);
loadModel();
