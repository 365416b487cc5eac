// The chat page of `verispec serve`: talks to the server's own /v1/chat/completions, streamed,
// and asks for the `speculation` extension of the chunks (verispec/serve/speculation.py) to
// mark each token by where it came from.
"use strict";

const config = JSON.parse(document.getElementById("config").textContent);
const $ = (id) => document.getElementById(id);
const conversation = $("conversation");
const history = [];  // the messages sent back to the server: {role, content}
let running = null;  // the answer being streamed: {controller, view}

const ORIGIN_LABEL = {
  accepted: "accepted draft",
  recovered: "recovered: drawn by the verifier at the first rejected draft",
  bonus: "bonus: drawn by the verifier after every draft was accepted",
  plain: "no draft this step: sampled from the target alone",
};

$("model-name").textContent = config.model;
$("drafter-name").textContent = config.drafter;

function addMessage(role, text) {
  const box = document.createElement("div");
  box.className = `message ${role}`;
  const who = document.createElement("span");
  who.className = "who";
  who.textContent = role === "user" ? "you" : role;
  const body = document.createElement("span");
  body.className = "body";
  body.textContent = text;
  box.append(who, body);
  conversation.append(box);
  conversation.scrollTop = conversation.scrollHeight;
  return box;
}

// A number typed in a field is sent as one; anything else is sent as typed, so that the
// server's own error (which names the field) is what the page shows.
function fieldValue(id) {
  const raw = $(id).value.trim();
  if (raw === "") return undefined;
  const number = Number(raw);
  return Number.isFinite(number) ? number : raw;
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({role: "system", content: system});
  messages.push(...history);
  const body = {model: config.model, messages, stream: true,
                stream_options: {include_usage: true, include_speculation: true}};
  for (const id of ["temperature", "top_p", "max_tokens", "seed", "guidance_scale", "num_speculative_tokens"]) {
    const value = fieldValue(id);
    if (value !== undefined) body[id] = value;
  }
  const negative = $("negative_prompt").value;
  if (negative.trim()) body.negative_prompt = negative;
  const schema = $("json_schema").value.trim();
  if (schema) {
    try {
      body.response_format = {type: "json_schema", json_schema: {name: "page", schema: JSON.parse(schema)}};
    } catch (_) {
      body.guided_json = schema;  // not JSON: the server says what is wrong with it
    }
  }
  return body;
}

// One streamed answer: its tokens as marked spans, its text, its speculation counts.
class AnswerView {
  constructor(box) {
    this.box = box;
    this.body = box.querySelector(".body");
    this.content = "";
    this.marked = false;
    this.tokens = 0;
    this.steps = 0;
    this.drafted = 0;
    this.accepted = 0;
    this.started = performance.now();
    box.dataset.state = "streaming";
    box.addEventListener("mouseover", (event) => this.highlight(event.target, true));
    box.addEventListener("mouseout", (event) => this.highlight(event.target, false));
  }

  highlight(target, on) {
    if (!target.classList.contains("tok")) return;
    for (const span of this.body.querySelectorAll(`.tok[data-step="${target.dataset.step}"]`)) {
      span.classList.toggle("same-step", on);
    }
  }

  addChoice(choice) {
    const text = (choice.delta && choice.delta.content) || "";
    this.content += text;
    const spec = choice.speculation;
    if (spec) {
      this.marked = true;
      this.steps += 1;
      this.drafted += spec.drafted;
      this.accepted += spec.accepted;
      for (const token of spec.tokens) {
        const span = document.createElement("span");
        span.className = `tok ${token.origin}`;
        span.dataset.origin = token.origin;
        span.dataset.step = spec.step;
        span.dataset.id = token.id;
        span.title = `step ${spec.step}: ${spec.accepted} of ${spec.drafted} drafts accepted\n` +
                     `token ${token.id}: ${ORIGIN_LABEL[token.origin] || token.origin}`;
        span.textContent = token.text;
        this.body.append(span);
        this.tokens += 1;
      }
    } else if (text && !this.marked) {
      this.body.append(text);
    }
    if (choice.finish_reason) this.box.dataset.finishReason = choice.finish_reason;
    this.showStats();
    conversation.scrollTop = conversation.scrollHeight;
  }

  showStats() {
    const seconds = (performance.now() - this.started) / 1000;
    $("stat-rate").textContent = seconds > 0 && this.tokens ? (this.tokens / seconds).toFixed(1) : "–";
    $("stat-acceptance").textContent = this.drafted ? `${(100 * this.accepted / this.drafted).toFixed(0)}%` : "–";
    $("stat-per-step").textContent = this.steps ? (this.tokens / this.steps).toFixed(2) : "–";
    $("stat-tokens").textContent = String(this.tokens);
  }

  // The tokens' texts run ahead of the content where a stop string was cut off the end.
  trimToContent() {
    if (!this.marked || this.body.textContent === this.content || !this.body.textContent.startsWith(this.content)) return;
    let left = this.content.length;
    for (const span of this.body.querySelectorAll(".tok")) {
      const keep = Math.min(left, span.textContent.length);
      if (keep < span.textContent.length) span.textContent = span.textContent.slice(0, keep);
      left -= keep;
    }
  }

  end(state, note) {
    this.box.dataset.state = state;
    if (note) {
      const line = document.createElement("span");
      line.className = state === "stopped" ? "note" : "note error";
      line.textContent = note;
      this.box.append(line);
    }
  }
}

function showError(message) {
  const box = addMessage("error", message);
  box.dataset.state = "error";
  return box;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return `${response.status}: ${body.error.message}`;
  } catch (_) { /* not JSON: fall through */ }
  return `${response.status}: ${response.statusText || "the server refused the request"}`;
}

async function readEvents(response, view) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return false;
    buffer += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return true;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new ServerError(chunk.error.message || "the server failed");
        for (const choice of chunk.choices || []) view.addChoice(choice);
      }
    }
  }
}

class ServerError extends Error {}

async function generate() {
  const controller = new AbortController();
  let response;
  setRunning({controller, view: null});
  try {
    response = await fetch("/v1/chat/completions", {
      method: "POST", headers: {"Content-Type": "application/json"},
      body: JSON.stringify(requestBody()), signal: controller.signal,
    });
  } catch (error) {
    setRunning(null);
    if (error.name !== "AbortError") showError(`Could not reach the server: ${error.message}`);
    return;
  }
  if (!response.ok) {
    const message = await errorMessage(response);
    setRunning(null);
    showError(message);
    return;
  }
  const mine = running;
  const view = new AnswerView(addMessage("assistant", ""));
  mine.view = view;
  let keep = true;  // whether the answer, whole or partial, stays in the conversation
  try {
    const complete = await readEvents(response, view);
    view.trimToContent();
    if (complete) view.end("done");
    else view.end("dropped", "The server closed the stream before the answer was complete.");
  } catch (error) {
    if (error.name === "AbortError") view.end("stopped", "Stopped.");
    else if (error instanceof ServerError) {
      view.end("error", `The server failed: ${error.message}`);
      keep = false;
    } else view.end("dropped", `The connection to the server was lost (${error.message}); the answer is incomplete.`);
  }
  if (running !== mine) return;  // cleared meanwhile
  if (keep) history.push({role: "assistant", content: view.content});
  setRunning(null);
}

function setRunning(state) {
  running = state;
  $("send").disabled = state !== null;
  $("stop").disabled = state === null;
  $("regenerate").disabled = state !== null || history.length === 0;
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value;
  if (running || !text.trim()) return;
  $("prompt").value = "";
  history.push({role: "user", content: text});
  addMessage("user", text);
  generate();
});

$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});

// Aborting the fetch closes the connection; the server aborts the request before its next step.
$("stop").addEventListener("click", () => { if (running) running.controller.abort(); });

$("regenerate").addEventListener("click", () => {
  if (running || history.length === 0) return;
  if (history[history.length - 1].role === "assistant") {
    history.pop();
    const answers = conversation.querySelectorAll(".message.assistant");
    answers[answers.length - 1].remove();
  }
  generate();
});

$("clear").addEventListener("click", () => {
  if (running) running.controller.abort();
  history.length = 0;
  conversation.replaceChildren();
  setRunning(null);
});
