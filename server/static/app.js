// The playground page: a chat that streams /v1/chat/completions and shows how lookahead decoding produced it.
//
// Contract: every request streams with stream_options.include_usage and the server's stream_steps extension,
// so each content chunk carries {"step": {"tokens", "accepted", "offered"}}: the text of a chunk is wrapped in
// a span coloured by its step's token count, live stats add the step counts up, and the final usage chunk's
// "decoding" object gives the totals. Stop aborts the fetch; the server sees the disconnect and cancels.
// Compare mode sends the same conversation twice, lookahead then {"lookahead": {"enabled": false}}.
"use strict";

const KEY_STORAGE = "lookahead-playground-api-key";
const MAX_BUCKET = 5;

const state = { messages: [], controller: null, running: false, stopped: false };

function $(id) {
  return document.getElementById(id);
}

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function setStatus(text, kind) {
  const status = $("server-status");
  status.textContent = text;
  status.dataset.kind = kind || "info";
}

function headers() {
  const result = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) result.Authorization = `Bearer ${key}`;
  return result;
}

function errorMessage(status, body) {
  const message = body && body.error && body.error.message;
  if (status === 401) return `${message || "Unauthorized"} Enter the server's API key in the settings.`;
  return message || `HTTP ${status}`;
}

// ---- server state -------------------------------------------------------------------------------------

// Resolves once /health answers 200, or 401 (a protected /health: the models request then asks for the key).
async function waitForHealth() {
  for (;;) {
    try {
      const response = await fetch("health", { headers: headers(), cache: "no-store" });
      if (response.ok || response.status === 401) return;
      const body = await response.json();
      setStatus(`server ${body.status}…`, "warn");
    } catch (error) {
      setStatus("server unreachable, retrying…", "error");
    }
    await new Promise((resolve) => setTimeout(resolve, 2000));
  }
}

async function loadModels() {
  const select = $("model");
  const response = await fetch("v1/models", { headers: headers(), cache: "no-store" });
  if (!response.ok) {
    const body = await response.json().catch(() => null);
    setStatus(errorMessage(response.status, body), response.status === 401 ? "warn" : "error");
    if (response.status === 401) $("api-key-row").classList.add("needed");
    return false;
  }
  const { data } = await response.json();
  const chosen = select.value;
  select.replaceChildren(...data.map((model) => new Option(model.id, model.id)));
  if (data.some((model) => model.id === chosen)) select.value = chosen;
  $("api-key-row").classList.remove("needed");
  setStatus(`ready · ${data.map((model) => model.id).join(", ")}`, "ok");
  return true;
}

// ---- requests -----------------------------------------------------------------------------------------

function numberField(id) {
  const value = $(id).value.trim();
  return value === "" ? undefined : Number(value);
}

function requestBody(messages, lookaheadEnabled) {
  const lookahead = { enabled: lookaheadEnabled };
  if (lookaheadEnabled) {
    for (const [id, name] of [["window-size", "window_size"], ["ngram-size", "ngram_size"],
      ["guess-set-size", "guess_set_size"]]) {
      const value = numberField(id);
      if (value !== undefined) lookahead[name] = value;
    }
  }
  const body = {
    messages,
    stream: true,
    stream_options: { include_usage: true },
    stream_steps: true,
    temperature: Number($("temperature").value),
    lookahead,
  };
  if ($("model").value) body.model = $("model").value;
  const maxTokens = numberField("max-tokens");
  if (maxTokens !== undefined) body.max_tokens = maxTokens;
  return body;
}

// Yields the data payload of each server-sent event of a fetch response.
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let boundary;
    while ((boundary = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, boundary);
      buffer = buffer.slice(boundary).replace(/^\r?\n\r?\n/, "");
      const lines = block.split(/\r?\n/).filter((line) => line.startsWith("data:"));
      if (lines.length) yield lines.map((line) => line.slice(5).replace(/^ /, "")).join("\n");
    }
  }
}

// ---- one streamed answer ------------------------------------------------------------------------------

class AnswerView {
  constructor(parent, label) {
    this.root = element("article", "answer");
    this.root.setAttribute("aria-label", label ? `Answer: ${label}` : "Answer");
    this.label = element("h3", "answer-label", label || "");
    if (label) this.root.append(this.label);
    this.text = element("div", "answer-text");
    this.stats = element("p", "stats");
    this.root.append(this.text, this.stats);
    parent.append(this.root);
    this.content = "";
    this.totals = { tokens: 0, steps: 0, accepted: 0, offered: 0 };
    this.decoding = null;
    this.usage = null;
    this.finishReason = null;
    this.started = performance.now();
    this.firstAt = null;
    this.endedAt = null;
    this.setState("waiting");
  }

  setState(name, detail) {
    this.state = name;
    this.detail = detail || "";
    this.stats.dataset.state = name;
    this.root.dataset.state = name;
    this.renderStats();
  }

  handle(chunk) {
    if (chunk.step) this.countStep(chunk.step);
    if (chunk.usage) this.usage = chunk.usage;
    if (chunk.decoding) this.showDecoding(chunk.decoding);
    const choice = chunk.choices && chunk.choices[0];
    if (!choice) return this.renderStats();
    if (choice.finish_reason) this.finishReason = choice.finish_reason;
    const text = choice.delta && choice.delta.content;
    if (text) this.appendText(text, chunk.step);
    else this.renderStats();
  }

  // The usage chunk's decoding object: keep it, and name the W/N/G actually used in the label.
  showDecoding(decoding) {
    this.decoding = decoding;
    if (decoding.method === "lookahead" && this.label.textContent.startsWith("lookahead")) {
      this.label.textContent = `lookahead W${decoding.window_size} N${decoding.ngram_size} G${decoding.guess_set_size}`;
    }
  }

  countStep(step) {
    this.totals.tokens += step.tokens;
    this.totals.steps += step.tokens > 0 ? 1 : 0;
    this.totals.accepted += step.accepted;
    this.totals.offered += step.offered;
  }

  appendText(text, step) {
    if (this.firstAt === null) this.firstAt = performance.now();
    if (this.state === "waiting") this.setState("streaming");
    const tokens = step ? step.tokens : 1;
    const span = element("span", `step s${Math.max(1, Math.min(tokens, MAX_BUCKET))}`, text);
    span.dataset.tokens = String(tokens);
    if (step && tokens > 1) span.title = `${tokens} tokens in one step (${step.accepted} from an accepted n-gram)`;
    this.text.append(span);
    this.content += text;
    this.renderStats();
    scrollToEnd();
  }

  finish(name, detail) {
    this.endedAt = performance.now();
    this.setState(name, detail);
  }

  seconds() {
    return ((this.endedAt || performance.now()) - this.started) / 1000;
  }

  // The numbers shown: the usage chunk's totals once it arrived, the step objects' running sums before.
  numbers() {
    const tokens = this.usage ? this.usage.completion_tokens : this.totals.tokens;
    const steps = this.decoding ? this.decoding.steps : this.totals.steps;
    const accepted = this.decoding ? this.decoding.accepted_tokens : this.totals.accepted;
    const offered = this.decoding ? this.decoding.offered_tokens : this.totals.offered;
    const seconds = this.seconds();
    return {
      tokens, steps, seconds,
      method: this.decoding ? this.decoding.method : null,
      tokensPerStep: steps ? tokens / steps : null,
      acceptance: offered ? accepted / offered : null,
      tokensPerSecond: seconds > 0 && tokens ? tokens / seconds : null,
    };
  }

  renderStats() {
    const n = this.numbers();
    const parts = [
      ["tokens", String(n.tokens)],
      ["steps", String(n.steps)],
      ["tokens/step", n.tokensPerStep === null ? "–" : n.tokensPerStep.toFixed(2)],
      ["acceptance", n.acceptance === null ? "–" : `${Math.round(n.acceptance * 100)}%`],
      ["tok/s", n.tokensPerSecond === null ? "–" : n.tokensPerSecond.toFixed(1)],
      ["time", `${n.seconds.toFixed(1)} s`],
    ];
    const items = parts.map(([name, value]) => {
      const item = element("span", "stat");
      item.dataset.stat = name;
      item.append(element("b", "", value));
      if (name !== "time") item.append(` ${name}`);
      return item;
    });
    const label = { waiting: "waiting…", streaming: "streaming…", done: this.finishReason === "length"
      ? "done (max tokens)" : "done", stopped: "stopped", skipped: "skipped", error: "error" }[this.state];
    const badge = element("span", `badge ${this.state}`, label);
    this.stats.replaceChildren(badge, ...items);
    if (this.detail) this.stats.append(element("span", "detail", this.detail));
  }
}

async function streamAnswer(view, body) {
  state.controller = new AbortController();
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: state.controller.signal,
    });
    if (!response.ok) {
      const error = await response.json().catch(() => null);
      return view.finish("error", errorMessage(response.status, error));
    }
    for await (const data of sseData(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) return view.finish("error", chunk.error.message);
      view.handle(chunk);
    }
    view.finish(state.stopped ? "stopped" : "done");
  } catch (error) {
    if (error.name === "AbortError") view.finish("stopped");
    else view.finish("error", String(error.message || error));
  } finally {
    state.controller = null;
  }
}

// ---- conversation -------------------------------------------------------------------------------------

function scrollToEnd() {
  const log = $("conversation");
  if (log.scrollHeight - log.scrollTop - log.clientHeight < 120) log.scrollTop = log.scrollHeight;
}

function addTurn(userText, compare) {
  $("empty-hint").hidden = true;
  const turn = element("div", "turn");
  const user = element("div", "user-message");
  user.setAttribute("aria-label", "You");
  user.textContent = userText;
  const answers = element("div", compare ? "answers compare" : "answers");
  turn.append(user, answers);
  $("conversation").append(turn);
  scrollToEnd();
  return answers;
}

function comparison(fast, slow) {
  const a = fast.numbers();
  const b = slow.numbers();
  if (fast.state !== "done" || slow.state !== "done" || !a.tokensPerSecond || !b.tokensPerSecond) return null;
  const steps = a.steps ? b.steps / a.steps : null;
  const text = `lookahead: ${(a.tokensPerSecond / b.tokensPerSecond).toFixed(2)}× tokens/s` +
    (steps ? `, ${steps.toFixed(2)}× fewer steps` : "") +
    (fast.content === slow.content ? ", identical text" : ", different text (sampling)");
  return element("p", "comparison", text);
}

async function send(text) {
  const compare = $("compare").checked;
  const enabled = $("lookahead-enabled").checked;
  state.messages.push({ role: "user", content: text });
  const messages = state.messages.slice();
  const answers = addTurn(text, compare);
  setRunning(true);
  let kept;
  if (compare) {
    const fast = new AnswerView(answers, "lookahead");
    const slow = new AnswerView(answers, "plain (lookahead off)");
    await streamAnswer(fast, requestBody(messages, true));
    if (state.stopped) slow.finish("skipped");
    else await streamAnswer(slow, requestBody(messages, false));
    const summary = comparison(fast, slow);
    if (summary) answers.after(summary);
    kept = fast;
  } else {
    kept = new AnswerView(answers, enabled ? "" : "plain (lookahead off)");
    await streamAnswer(kept, requestBody(messages, enabled));
  }
  if (kept.content) state.messages.push({ role: "assistant", content: kept.content });
  fillDefaults(kept.decoding);
  setRunning(false);
}

// Show the server's W/N/G defaults as placeholders once a lookahead answer reported them.
function fillDefaults(decoding) {
  if (!decoding || decoding.method !== "lookahead") return;
  for (const [id, name] of [["window-size", "window_size"], ["ngram-size", "ngram_size"],
    ["guess-set-size", "guess_set_size"]]) {
    if ($(id).value.trim() === "") $(id).placeholder = String(decoding[name]);
  }
}

function setRunning(running) {
  state.running = running;
  if (running) state.stopped = false;
  $("send").disabled = running;
  $("stop").disabled = !running;
  document.body.classList.toggle("running", running);
  if (!running) $("message").focus();
}

function stop() {
  if (!state.running) return;
  state.stopped = true;
  if (state.controller) state.controller.abort();
}

function newChat() {
  stop();
  state.messages = [];
  $("conversation").replaceChildren($("empty-hint"));
  $("empty-hint").hidden = false;
  $("message").focus();
}

// ---- wiring -------------------------------------------------------------------------------------------

function submitMessage(event) {
  if (event) event.preventDefault();
  const input = $("message");
  const text = input.value.trim();
  if (!text || state.running) return;
  input.value = "";
  send(text);
}

function onKeyDown(event) {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) submitMessage(event);
  else if (event.key === "Escape") stop();
}

function wire() {
  $("composer").addEventListener("submit", submitMessage);
  $("message").addEventListener("keydown", onKeyDown);
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  $("settings").addEventListener("submit", (event) => event.preventDefault());
  const temperature = $("temperature");
  temperature.addEventListener("input", () => { $("temperature-value").textContent = temperature.value; });
  const key = $("api-key");
  key.value = sessionStorage.getItem(KEY_STORAGE) || "";
  key.addEventListener("change", () => {
    sessionStorage.setItem(KEY_STORAGE, key.value.trim());
    loadModels();
  });
}

async function main() {
  wire();
  $("message").focus();
  await waitForHealth();
  await loadModels();
}

main();
