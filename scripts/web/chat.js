// The chat page: a conversation with the served model over its own /v1/chat/completions, streamed. The whole
// conversation is sent with each question (the server keeps nothing between requests); Stop aborts the fetch,
// and the server, seeing its client gone, stops generating. The think text (reasoning_content) is shown folded
// apart from the answer; tool calls, when a reply has them, folded too. Errors are shown as messages. A server
// started with --api_key answers 401: the page then asks for the key once and sends it with each request.
"use strict";

const TEXT = {
  en: {
    language: "中文", model_loading: "connecting…", new_chat: "New chat", settings: "Settings",
    system_prompt: "System prompt", system_placeholder: "optional, e.g. Answer briefly.",
    temperature: "Temperature (0: greedy)", max_tokens: "Max tokens", send: "Send", stop: "Stop",
    input_placeholder: "Ask something. Enter sends, Shift+Enter starts a new line.",
    thinking: "Thinking", tool_call: "Tool call", stopped: "Stopped.",
    key_needed: "This server asks for its API key (--api_key):", use_key: "Use key",
    key_wrong: "The server did not take that key. Its API key (--api_key):",
    no_models: (m) => `The server does not answer: ${m}`,
    refused: (status, m) => `The server refused the request (${status}): ${m}`,
    unreachable: (m) => `The server could not be reached: ${m}`,
    cut_tokens: (n) => `Cut off: the reply reached max tokens (${n}).`,
    cut_time: (s) => `Cut off by the server: a reply may take ${s} s (--request_time_limit), or the conversation ` +
      "filled the model's context.",
    usage: (p, c) => `${p} prompt + ${c} reply tokens`,
    limits: (l) => `This server: max tokens up to ${l.max_tokens_limit} (default ${l.max_tokens_default}), ` +
      `${l.request_time_limit_s} s per reply, requests up to ${l.max_request_bytes} bytes.`,
  },
  zh: {
    language: "English", model_loading: "连接中…", new_chat: "新对话", settings: "设置",
    system_prompt: "系统提示词", system_placeholder: "可选，例如：请简短回答。",
    temperature: "温度（0：贪心）", max_tokens: "最大 token 数", send: "发送", stop: "停止",
    input_placeholder: "输入问题。Enter 发送，Shift+Enter 换行。",
    thinking: "思考过程", tool_call: "工具调用", stopped: "已停止。",
    key_needed: "此服务器需要 API 密钥（--api_key）：", use_key: "使用密钥",
    key_wrong: "服务器未接受该密钥。请输入它的 API 密钥（--api_key）：",
    no_models: (m) => `服务器没有响应：${m}`,
    refused: (status, m) => `服务器拒绝了请求（${status}）：${m}`,
    unreachable: (m) => `无法连接服务器：${m}`,
    cut_tokens: (n) => `已截断：回复达到最大 token 数（${n}）。`,
    cut_time: (s) => `已被服务器截断：每个回复最多 ${s} 秒（--request_time_limit），或对话已占满模型的上下文。`,
    usage: (p, c) => `提示 ${p} + 回复 ${c} 个 token`,
    limits: (l) => `本服务器：最大 token 数不超过 ${l.max_tokens_limit}（默认 ${l.max_tokens_default}），` +
      `每个回复 ${l.request_time_limit_s} 秒，请求不超过 ${l.max_request_bytes} 字节。`,
  },
};

const $ = (id) => document.getElementById(id);
const chosen = new URLSearchParams(location.search).get("lang") || localStorage.getItem("chat.language");
let language = chosen in TEXT ? chosen : (navigator.language || "").startsWith("zh") ? "zh" : "en";
let limits = null; // GET /v1/models: the served model's limits
let history = []; // the conversation so far: {role, content}, the system prompt apart
let controller = null; // the reply being streamed: its AbortController
let chatNumber = 0; // a new chat makes a reply still ending belong to no conversation
let apiKey = sessionStorage.getItem("chat.api_key"); // the server's --api_key, once asked: kept for this tab only

const t = (key) => TEXT[language][key];

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function addMessage(kind, text) {
  const node = element("div", `message ${kind}`, text);
  $("messages").appendChild(node);
  scrollDown();
  return node;
}

function scrollDown() {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

function applyLanguage() {
  document.documentElement.lang = language === "zh" ? "zh-CN" : "en";
  for (const node of document.querySelectorAll("[data-text]")) node.textContent = t(node.dataset.text);
  for (const node of document.querySelectorAll("[data-placeholder]")) node.placeholder = t(node.dataset.placeholder);
  $("language").textContent = t("language");
  $("limits").textContent = limits ? t("limits")(limits) : "";
}

// With the key, when the page has one: "Authorization: Bearer KEY", as OpenAI's clients send it.
const withKey = (headers) => (apiKey === null ? headers : { ...headers, Authorization: `Bearer ${apiKey}` });

function askForKey() {
  $("key-label").dataset.text = apiKey === null ? "key_needed" : "key_wrong";
  $("key-label").textContent = t($("key-label").dataset.text);
  $("key-form").hidden = false;
  $("api-key").focus();
}

// ---- one reply, as its chunks arrive --------------------------------------------------------------

function replyView() {
  const box = addMessage("assistant");
  const think = element("details", "think");
  think.hidden = true; // until the reply has think text
  const thinkText = element("div", "text");
  think.append(element("summary", "", t("thinking")), thinkText);
  const tools = element("div", "tools");
  const answer = element("div", "answer");
  box.append(think, tools, answer);
  return { box, think, thinkText, tools, answer, reasoning: "", content: "", toolCalls: [], drawing: false };
}

function drawAnswer(view) {
  renderMarkdown(view.answer, view.content);
  scrollDown();
}

// One chunk's delta: reasoning_content, content, tool_calls (OpenAI's shape: pieces by index).
function applyDelta(view, delta) {
  if (delta.reasoning_content) {
    view.reasoning += delta.reasoning_content;
    view.thinkText.textContent = view.reasoning;
    view.think.hidden = false;
  }
  if (delta.content) {
    view.content += delta.content;
    if (!view.drawing) { // once a frame at most: a long reply is drawn again whole each time
      view.drawing = true;
      requestAnimationFrame(() => { view.drawing = false; drawAnswer(view); });
    }
  }
  for (const piece of delta.tool_calls || []) {
    const call = (view.toolCalls[piece.index || 0] ||= { name: "", arguments: "" });
    call.name += (piece.function && piece.function.name) || "";
    call.arguments += (piece.function && piece.function.arguments) || "";
    view.tools.replaceChildren(...view.toolCalls.map((c) => {
      const folded = element("details", "tool-call");
      folded.append(element("summary", "", `${t("tool_call")}: ${c.name}`), element("pre", "", c.arguments));
      return folded;
    }));
  }
}

// Calls onChunk with each server-sent event's JSON until "data: [DONE]" or the end of the body.
async function readStream(response, onChunk) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    for (let end; (end = buffer.indexOf("\n\n")) >= 0; buffer = buffer.slice(end + 2)) {
      for (const line of buffer.slice(0, end).split("\n")) {
        if (!line.startsWith("data:")) continue; // ": writing", a comment: the reply goes on
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        onChunk(JSON.parse(data));
      }
    }
  }
}

async function errorText(response) {
  const text = await response.text();
  try {
    return JSON.parse(text).error.message;
  } catch {
    return text || response.statusText;
  }
}

function numberSetting(id) {
  const value = $(id).value.trim();
  return value === "" ? undefined : Number(value); // as typed: the server names a value it does not take
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

async function send(text) {
  const chat = chatNumber;
  const question = { role: "user", content: text };
  addMessage("user", text);
  const system = $("system").value.trim();
  const body = { messages: [...(system ? [{ role: "system", content: system }] : []), ...history, question],
                 stream: true, temperature: numberSetting("temperature"), top_p: numberSetting("top_p"),
                 max_tokens: numberSetting("max_tokens") }; // undefined ones are left out of the JSON
  controller = new AbortController();
  setBusy(true);
  const view = replyView();
  let finish = null;
  let usage = null;
  try {
    const response = await fetch("v1/chat/completions", { method: "POST", body: JSON.stringify(body),
      headers: withKey({ "Content-Type": "application/json" }), signal: controller.signal });
    if (!response.ok) { // 400 naming the field, 413 naming --max_request_bytes: the question is not kept
      if (response.status === 401) askForKey();
      view.box.replaceWith(element("div", "message error", t("refused")(response.status, await errorText(response))));
      return;
    }
    await readStream(response, (chunk) => {
      const choice = chunk.choices[0];
      applyDelta(view, choice.delta || {});
      finish = choice.finish_reason || finish;
      usage = chunk.usage || usage;
    });
    if (finish === "length") {
      const asked = body.max_tokens || (limits && limits.max_tokens_default);
      view.box.appendChild(element("div", "note", usage && usage.completion_tokens >= asked
        ? t("cut_tokens")(asked) : t("cut_time")(limits ? limits.request_time_limit_s : "?")));
    }
    if (usage) view.box.appendChild(element("div", "usage", t("usage")(usage.prompt_tokens, usage.completion_tokens)));
  } catch (error) {
    if (error.name !== "AbortError") {
      view.box.after(element("div", "message error", t("unreachable")(error.message)));
      return;
    }
    view.box.appendChild(element("div", "note", t("stopped")));
  } finally {
    if (controller && chat === chatNumber) controller = null;
    if (chat === chatNumber) setBusy(false);
    drawAnswer(view);
  }
  if (chat === chatNumber && (view.content || view.toolCalls.length)) {
    history.push(question, { role: "assistant", content: view.content }); // the answer, not the think text
  }
}

// ---- the page's controls -------------------------------------------------------------------------

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("input").value.trim();
  if (!text || controller) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (event) => {
  // isComposing: Enter also ends a Chinese input method's composition, which is no request to send
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("new-chat").addEventListener("click", () => {
  chatNumber += 1;
  if (controller) controller.abort();
  controller = null;
  setBusy(false);
  history = [];
  $("messages").replaceChildren();
  $("input").focus();
});
$("language").addEventListener("click", () => {
  language = language === "zh" ? "en" : "zh";
  localStorage.setItem("chat.language", language);
  applyLanguage();
});

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  apiKey = $("api-key").value.trim();
  sessionStorage.setItem("chat.api_key", apiKey);
  $("api-key").value = "";
  $("key-form").hidden = true;
  loadModel();
});

function loadModel() {
  fetch("v1/models", { headers: withKey({}) }).then(async (response) => {
    if (response.status === 401) return askForKey();
    if (!response.ok) throw new Error(`${response.status}: ${await errorText(response)}`);
    const model = (await response.json()).data[0];
    limits = model;
    const label = $("model");
    delete label.dataset.text;
    label.textContent = model.id;
    $("max_tokens").placeholder = model.max_tokens_default;
    $("max_tokens").max = model.max_tokens_limit;
    applyLanguage();
  }).catch((error) => addMessage("error", t("no_models")(error.message)));
}

applyLanguage();
loadModel();
