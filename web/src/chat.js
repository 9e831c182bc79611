// The chat page: streams /v1/chat/completions and renders the model's Markdown, with
// highlighted code and KaTeX math, through DOMPurify. The conversation is kept in
// sessionStorage (this browser tab only); Stop aborts the request, which cancels it on the
// server. For a model that reads images (its /v1/models entry lists "image" among its
// input_modalities) an image may be picked, pasted or dropped: shown in the user's message and
// sent as an OpenAI image_url part holding a data URL.
import DOMPurify from "dompurify";
import hljs from "highlight.js/lib/common";
import katexModule from "@vscode/markdown-it-katex";
import MarkdownIt from "markdown-it";
import "highlight.js/styles/github.css";
import "katex/dist/katex.min.css";
import "./chat.css";

// A CommonJS module whose plugin is its `default` export; imported from an ES module (this
// package is "type": "module"), the whole exports object is the default.
const katexPlugin = katexModule.default ?? katexModule;

const STORE = "mlxinfer.chat";
const KEY = "mlxinfer.key";

// html: false: raw HTML in the model's output is shown as text, never parsed; DOMPurify then
// cleans what markdown-it and KaTeX produced, as a second line.
const md = new MarkdownIt({
  html: false,
  linkify: true,
  highlight(code, lang) {
    const language = lang && hljs.getLanguage(lang) ? lang : null;
    const html = language
      ? hljs.highlight(code, { language, ignoreIllegals: true }).value
      : hljs.highlightAuto(code).value;
    return `<pre class="hljs"><code>${html}</code></pre>`;
  },
}).use(katexPlugin, { throwOnError: false });

// KaTeX's MathML keeps the TeX source in <semantics><annotation> (for screen readers and
// copying); DOMPurify drops those two by default. annotation-xml stays forbidden.
const PURIFY = { ADD_TAGS: ["semantics", "annotation"], ADD_ATTR: ["encoding"] };

export function render(markdown) {
  return DOMPurify.sanitize(md.render(markdown), PURIFY);
}

const $ = (id) => document.getElementById(id);
const log = $("log");
const state = { messages: load(), controller: null, images: [], vision: new Set() };
const IMAGE_TYPES = ["image/png", "image/jpeg", "image/webp", "image/gif"];

function load() {
  try {
    const saved = JSON.parse(sessionStorage.getItem(STORE) || "[]");
    return Array.isArray(saved) ? saved : [];
  } catch {
    return [];
  }
}

function save() {
  try {
    sessionStorage.setItem(STORE, JSON.stringify(state.messages));
  } catch {
    status("This conversation is too large to keep across a reload (its images).");
  }
}

function bubble(role) {
  const div = document.createElement("div");
  div.className = `message ${role}`;
  log.appendChild(div);
  return div;
}

// A user message's content: a string, or OpenAI parts (image_url data URLs, then text).
function showUser(div, content) {
  if (typeof content === "string") {
    div.textContent = content;
    return;
  }
  div.replaceChildren();
  for (const part of content) {
    if (part.type === "image_url") div.appendChild(thumbnail(part.image_url.url));
    else if (part.type === "text") div.appendChild(document.createTextNode(part.text));
  }
}

function thumbnail(url) {
  const img = document.createElement("img");
  if (url.startsWith("data:image/")) img.src = url; // our own data URLs, nothing remote
  img.alt = "image";
  return img;
}

function show(div, message) {
  if (message.role === "user") {
    showUser(div, message.content);
  } else {
    div.innerHTML = render(message.content);
  }
  if (message.note) {
    const note = document.createElement("div");
    note.className = "note";
    note.textContent = message.note;
    div.appendChild(note);
  }
}

function status(text) {
  $("status").textContent = text;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(KEY);
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function errorOf(response) {
  try {
    const body = await response.json();
    return body.error?.message || JSON.stringify(body);
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

async function models() {
  const response = await fetch("v1/models", { headers: headers() });
  if (response.status === 401) {
    $("key-label").hidden = false;
    status("This server needs an API key.");
    return;
  }
  if (!response.ok) {
    status(await errorOf(response));
    return;
  }
  // The new list replaces the old one in one step, after the last await: the select is never
  // empty in between (two listings in flight, as a key typed and then changed makes, left a
  // request sent meanwhile with no model).
  const listed = (await response.json()).data;
  const options = listed.map((m) => {
    const option = document.createElement("option");
    option.value = option.textContent = m.id;
    return option;
  });
  const select = $("model");
  select.replaceChildren(...options);
  state.vision = new Set(listed.filter((m) => m.input_modalities?.includes("image")).map((m) => m.id));
  const chosen = sessionStorage.getItem("mlxinfer.model");
  if (chosen && [...select.options].some((o) => o.value === chosen)) select.value = chosen;
  modelChanged();
}

// Images only for a model that reads them: the picker shows, and what was attached stays.
function modelChanged() {
  const vision = state.vision.has($("model").value);
  $("attach").hidden = !vision;
  if (!vision) state.images = [];
  showAttached();
}

function showAttached() {
  const area = $("attached");
  area.replaceChildren();
  state.images.forEach((url, i) => {
    const img = thumbnail(url);
    img.title = "Remove this image";
    img.addEventListener("click", () => {
      state.images.splice(i, 1);
      showAttached();
    });
    area.appendChild(img);
  });
  area.hidden = state.images.length === 0;
}

function attach(files) {
  if (!state.vision.has($("model").value)) return false;
  const images = [...files].filter((f) => IMAGE_TYPES.includes(f.type));
  for (const file of images) {
    const reader = new FileReader();
    reader.onload = () => {
      state.images.push(reader.result);
      showAttached();
    };
    reader.readAsDataURL(file);
  }
  return images.length > 0;
}

// Each `data:` event of an SSE stream, as parsed JSON (comments and [DONE] skipped).
async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

async function send(text, images) {
  const parts = images.map((url) => ({ type: "image_url", image_url: { url } }));
  const content = images.length ? [...parts, ...(text ? [{ type: "text", text }] : [])] : text;
  state.messages.push({ role: "user", content });
  save();
  show(bubble("user"), state.messages.at(-1));
  const reply = { role: "assistant", content: "" };
  const div = bubble("assistant");
  div.classList.add("streaming");
  const controller = new AbortController();
  state.controller = controller;
  busy(true);
  const started = performance.now();
  let tokens = 0;
  let first = null;
  let pending = false;
  const paint = () => {
    pending = false;
    show(div, reply);
    log.scrollTop = log.scrollHeight;
  };
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST",
      headers: headers(),
      signal: controller.signal,
      body: JSON.stringify({
        model: $("model").value,
        messages: state.messages.map(({ role, content }) => ({ role, content })),
        stream: true,
        stream_options: { include_usage: true },
      }),
    });
    if (!response.ok) throw new Error(await errorOf(response));
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
      const piece = chunk.choices?.[0]?.delta?.content;
      if (piece) {
        first ??= performance.now();
        reply.content += piece;
        if (!pending) {
          pending = true;
          requestAnimationFrame(paint);
        }
      }
    }
    const seconds = (performance.now() - (first ?? started)) / 1000;
    if (tokens) reply.note = `${tokens} tokens, ${(tokens / Math.max(seconds, 1e-3)).toFixed(1)} tok/s`;
  } catch (e) {
    reply.note = e.name === "AbortError" ? "stopped" : `error: ${e.message}`;
  } finally {
    state.controller = null;
    busy(false);
    div.classList.remove("streaming");
    paint();
    state.messages.push(reply);
    save();
  }
}

function busy(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  $("prompt").disabled = on;
  document.body.dataset.busy = on ? "1" : "";
}

$("ask").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  const images = state.images;
  if ((!text && !images.length) || state.controller) return;
  $("prompt").value = "";
  state.images = [];
  showAttached();
  send(text, images).finally(() => $("prompt").focus());
});
$("image").addEventListener("change", (event) => {
  attach(event.target.files);
  event.target.value = ""; // the same file may be picked again
});
$("prompt").addEventListener("paste", (event) => {
  if (attach(event.clipboardData?.files ?? [])) event.preventDefault();
});
// A file dropped anywhere on the page is attached (never opened in place of the page).
document.addEventListener("dragover", (event) => {
  if (event.dataTransfer?.types.includes("Files")) event.preventDefault();
});
document.addEventListener("drop", (event) => {
  if (!event.dataTransfer?.files.length) return;
  event.preventDefault();
  attach(event.dataTransfer.files);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("ask").requestSubmit();
  }
});
$("stop").addEventListener("click", () => state.controller?.abort());
$("clear").addEventListener("click", () => {
  state.controller?.abort();
  state.messages = [];
  save();
  log.replaceChildren();
});
$("model").addEventListener("change", () => {
  sessionStorage.setItem("mlxinfer.model", $("model").value);
  modelChanged();
});
$("key").addEventListener("change", () => {
  sessionStorage.setItem(KEY, $("key").value);
  models();
});

for (const message of state.messages) show(bubble(message.role), message);
models();
