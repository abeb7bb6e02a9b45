// The live page: streams /v1/completions and marks each token by where it came from
// (an accepted draft proposal, or the target's own token), with running statistics
// and a bar per round.  No libraries: everything is served by the server.
//
// Keeping pace with the server: the stream is read as it comes, but the page is
// updated at most once per frame with everything that arrived since the last one
// (one DOM insertion of new tokens, new bars appended to the chart whose scale is its
// viewBox: nothing drawn before is redrawn).
"use strict";

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";
const STATS = ["tok-s", "alpha", "tpr", "rounds", "tokens"];
let controller = null;
let run = null;            // the current generation: what arrived and is not shown yet, counts

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

function clearStats() {
  for (const id of STATS) $(id).textContent = "–";
}

function number(id, parse) {
  const v = $(id).value.trim();
  return v === "" ? undefined : parse(v);
}

function body() {
  return JSON.stringify({
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
    stream_options: { include_usage: true },
  });
}

function newRun() {
  return { waiting: [], stats: null, rounds: 0, tokens: 0, top: 1, cancel: null };
}

function schedule() {
  if (run.cancel) return;
  if (document.hidden) {      // a hidden page gets no animation frames: a timer then
    const id = setTimeout(show, 50);
    run.cancel = () => clearTimeout(id);
  } else {
    const id = requestAnimationFrame(show);
    run.cancel = () => cancelAnimationFrame(id);
  }
}

function flush() {            // now, not at the next frame
  if (run.cancel) run.cancel();
  show();
}

function bar(cls, x, y, h) {
  const r = document.createElementNS(SVG, "rect");
  r.setAttribute("class", cls);
  r.setAttribute("x", x + 0.1);
  r.setAttribute("width", 0.8);
  r.setAttribute("y", y);
  r.setAttribute("height", h);
  return r;
}

// Everything that arrived since the last frame, in one DOM update.
function show() {
  if (!run) return;
  run.cancel = null;
  const text = document.createDocumentFragment(), bars = document.createDocumentFragment();
  for (const spel of run.waiting) {
    spel.token_text.forEach((t, i) => {
      const span = document.createElement("span");
      span.className = "tok " + (spel.from_draft[i] ? "draft" : "target");
      span.textContent = t;
      span.title = "token " + spel.tokens[i] + (spel.from_draft[i] ? " (draft)" : " (target)");
      text.appendChild(span);
    });
    const drafted = spel.from_draft.filter(Boolean).length, own = spel.tokens.length - drafted;
    if (drafted) bars.appendChild(bar("d", run.rounds, -drafted, drafted));
    if (own) bars.appendChild(bar("t", run.rounds, -(drafted + own), own));
    run.top = Math.max(run.top, drafted + own);
    run.rounds += 1;
    run.tokens += spel.tokens.length;
  }
  run.waiting = [];
  $("output").appendChild(text);
  $("bars").appendChild(bars);
  $("chart").setAttribute("viewBox", `0 ${-run.top} ${Math.max(run.rounds, 40)} ${run.top}`);
  $("rounds").textContent = run.rounds;
  $("tokens").textContent = run.tokens;
  const s = run.stats;
  if (s) {
    if (s.tok_s !== undefined) $("tok-s").textContent = s.tok_s.toFixed(0);
    if (s.alpha !== undefined) $("alpha").textContent = s.alpha.toFixed(3);
    if (s.tokens_per_round !== undefined) $("tpr").textContent = s.tokens_per_round.toFixed(2);
  }
}

function handle(data) {
  const msg = JSON.parse(data);
  if (msg.error) throw new Error(msg.error.message);
  const choice = msg.choices[0];
  if (msg.spel) {
    if (msg.spel.token_text) run.waiting.push(msg.spel);
    else if (choice && choice.text) run.waiting.push({ token_text: [choice.text], from_draft: [false], tokens: [] });
    run.stats = msg.spel;
    schedule();
  }
  if (choice && choice.finish_reason) run.finish = choice.finish_reason;
  if (msg.usage) {
    flush();
    setStatus(`done: ${run.finish}, ${msg.usage.completion_tokens} tokens`, "done");
  }
}

async function read(resp) {
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
        if (line.startsWith("data: ") && line !== "data: [DONE]") handle(line.slice(6));
      }
    }
  }
}

async function generate(ev) {
  ev.preventDefault();
  if (run && run.cancel) run.cancel();
  run = newRun();
  const echo = document.createElement("span");
  echo.className = "prompt-echo";
  echo.textContent = $("prompt").value;
  $("output").replaceChildren(echo);
  $("bars").replaceChildren();
  $("chart").setAttribute("viewBox", "0 -1 40 1");
  clearStats();
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
    await read(resp);
  } catch (e) {
    flush();
    if (e.name === "AbortError") {
      setStatus("stopped", "done");
    } else {
      run = null;         // nothing more is shown of it, and its statistics go:
      clearStats();       // they no longer describe a run that finished
      setStatus("error: " + e.message, "error");
    }
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
