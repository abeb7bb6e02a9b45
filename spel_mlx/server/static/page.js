// The live page: streams /v1/completions and colours each token by where it came
// from (an accepted draft proposal, or the target's own token), with running
// statistics and a per-round chart.  No libraries: everything is served by the server.
"use strict";

const $ = (id) => document.getElementById(id);
let controller = null;
let rounds = [];

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function setStatus(text, state) {
  $("status").textContent = text;
  $("status").dataset.state = state;
}

function number(id, parse) {
  const v = $(id).value.trim();
  return v === "" ? undefined : parse(v);
}

function body() {
  const b = {
    prompt: $("prompt").value,
    max_tokens: number("max-tokens", parseInt),
    temperature: number("temperature", parseFloat),
    top_p: number("top-p", parseFloat),
    repetition_penalty: number("repetition-penalty", parseFloat),
    seed: number("seed", parseInt),
    k: number("k", parseInt),
    mode: $("mode").value,
    draft: $("draft").value || undefined,
    stream: true,
  };
  return JSON.stringify(b);
}

function showStats(s) {
  if (s.tok_s !== undefined) $("tok-s").textContent = s.tok_s.toFixed(0);
  if (s.alpha !== undefined) $("alpha").textContent = s.alpha.toFixed(3);
  if (s.tokens_per_round !== undefined) $("tpr").textContent = s.tokens_per_round.toFixed(2);
}

function addTokens(spel) {
  const out = $("output");
  spel.token_text.forEach((text, i) => {
    const span = document.createElement("span");
    span.className = "tok " + (spel.from_draft[i] ? "draft" : "target");
    span.textContent = text;
    span.title = "token " + spel.tokens[i] + (spel.from_draft[i] ? " (draft)" : " (target)");
    out.appendChild(span);
  });
  const drafted = spel.from_draft.filter(Boolean).length;
  rounds.push([drafted, spel.tokens.length - drafted]);
  $("rounds").textContent = rounds.length;
  $("tokens").textContent = rounds.reduce((a, r) => a + r[0] + r[1], 0);
  drawChart();
}

function drawChart() {
  const svg = $("chart");
  const w = svg.clientWidth || 900, h = 90;
  const n = Math.max(rounds.length, 40), bw = w / n;
  const top = Math.max(1, ...rounds.map((r) => r[0] + r[1]));
  const ns = "http://www.w3.org/2000/svg";
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  svg.replaceChildren();
  rounds.forEach(([d, t], i) => {
    [[d, "d", 0], [t, "t", d]].forEach(([count, cls, below]) => {
      if (!count) return;
      const r = document.createElementNS(ns, "rect");
      r.setAttribute("class", cls);
      r.setAttribute("x", i * bw + 0.5);
      r.setAttribute("width", Math.max(1, bw - 1));
      r.setAttribute("y", h - ((below + count) / top) * (h - 4));
      r.setAttribute("height", (count / top) * (h - 4));
      svg.appendChild(r);
    });
  });
}

function handle(data) {
  const msg = JSON.parse(data);
  if (msg.error) throw new Error(msg.error.message);
  const choice = msg.choices[0];
  if (msg.spel && msg.spel.token_text) addTokens(msg.spel);
  else if (choice && choice.text) $("output").append(choice.text);
  if (msg.spel) showStats(msg.spel);
  if (choice && choice.finish_reason) {
    setStatus(`done: ${choice.finish_reason}, ${msg.usage.completion_tokens} tokens`, "done");
  }
}

async function generate(ev) {
  ev.preventDefault();
  const echo = document.createElement("span");
  echo.className = "prompt-echo";
  echo.textContent = $("prompt").value;
  $("output").replaceChildren(echo);
  rounds = [];
  drawChart();
  controller = new AbortController();
  $("generate").disabled = true;
  $("stop").disabled = false;
  setStatus("waiting…", "running");
  try {
    const resp = await fetch("/v1/completions", {
      method: "POST", headers: headers(), body: body(), signal: controller.signal });
    if (!resp.ok) {
      const err = await resp.json().catch(() => ({ error: { message: resp.statusText } }));
      throw new Error(`${resp.status}: ${err.error.message}`);
    }
    setStatus("streaming…", "running");
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          handle(data);
        }
      }
    }
  } catch (e) {
    if (e.name === "AbortError") setStatus("stopped", "done");
    else setStatus("error: " + e.message, "error");
  } finally {
    $("generate").disabled = false;
    $("stop").disabled = true;
    controller = null;
  }
}

function showModel() {
  fetch("/v1/models", { headers: headers() })
    .then((r) => r.json())
    .then((m) => { $("model").textContent = m.data ? m.data[0].id : "(API key needed)"; })
    .catch(() => {});
}

$("form").addEventListener("submit", generate);
$("stop").addEventListener("click", () => controller && controller.abort());
$("api-key").addEventListener("change", showModel);
showModel();
