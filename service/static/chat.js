// The Chat view: a conversation with a loaded model over POST /v1/chat/completions (stream: true), with a stop
// (the fetch aborted: the server ends the generation when its client leaves), a system prompt, the temperature and
// the figures of each answer (tokens a second, prompt tokens and the cached ones the server reports in
// usage.prompt_tokens_details.cached_tokens). Answers are Markdown drawn by ``markdown`` below, which only ever makes
// elements and text nodes: no model output is parsed as HTML, and none can run as script.
"use strict";

(function () {
  const G = window.GGUF;
  const { $, el, clear, isNum } = G;

  // ---------- Markdown, safely: a small subset, every piece of text a text node ----------

  const INLINE = [
    { kind: "code", re: /`([^`\n]+)`/ },
    { kind: "strong", re: /\*\*([^*\s](?:[^*\n]*[^*\s])?)\*\*/ },
    { kind: "em", re: /\*([^*\s](?:[^*\n]*[^*\s])?)\*/ },
    { kind: "link", re: /\[([^\]\n]+)\]\(([^()\s]+)\)/ },
  ];
  const SAFE_URL = /^https?:\/\/[^\s]+$/i;

  // Text with inline marks into ``parent``: the earliest mark first, the text around it as text nodes.
  function inline(text, parent) {
    let rest = text;
    while (rest) {
      let best = null;
      for (const rule of INLINE) {
        const m = rule.re.exec(rest);
        if (m && (best === null || m.index < best.m.index)) best = { rule, m };
      }
      if (best === null) { parent.appendChild(document.createTextNode(rest)); return; }
      const { rule, m } = best;
      if (m.index > 0) parent.appendChild(document.createTextNode(rest.slice(0, m.index)));
      if (rule.kind === "code") {
        parent.appendChild(el("code", {}, m[1]));
      } else if (rule.kind === "link") {
        if (SAFE_URL.test(m[2])) {
          const a = el("a", { href: m[2], rel: "noopener noreferrer nofollow", target: "_blank" });
          inline(m[1], a);
          parent.appendChild(a);
        } else {
          parent.appendChild(document.createTextNode(m[0]));  // javascript:, data: and the rest stay text
        }
      } else {
        const node = el(rule.kind);
        inline(m[1], node);
        parent.appendChild(node);
      }
      rest = rest.slice(m.index + m[0].length);
    }
  }

  function lines(parent, textLines) {
    textLines.forEach((t, i) => {
      if (i) parent.appendChild(el("br"));
      inline(t, parent);
    });
  }

  // Markdown into a fragment: fenced code, headings, lists, quotes, rules and paragraphs. An unclosed fence (an
  // answer still streaming) is code up to the end.
  function markdown(text) {
    const out = document.createDocumentFragment();
    const src = String(text).replace(/\r\n?/g, "\n").split("\n");
    let i = 0;
    while (i < src.length) {
      const line = src[i];
      const fence = /^\s*```\s*([\w+-]*)/.exec(line);
      if (fence) {
        const body = [];
        i++;
        while (i < src.length && !/^\s*```\s*$/.test(src[i])) body.push(src[i++]);
        i++;
        const pre = el("pre");
        pre.appendChild(el("code", fence[1] ? { "data-lang": fence[1] } : {}, body.join("\n")));
        out.appendChild(pre);
        continue;
      }
      const heading = /^(#{1,6})\s+(.*)$/.exec(line);
      if (heading) {
        const h = el("h" + Math.min(6, heading[1].length + 2));  // h3..h6: under the page's own headings
        inline(heading[2], h);
        out.appendChild(h);
        i++;
        continue;
      }
      if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(line)) { out.appendChild(el("hr")); i++; continue; }
      const item = /^\s*(?:[-*+]|(\d+)[.)])\s+/;
      if (item.test(line)) {
        const ordered = Boolean(item.exec(line)[1]);
        const list = el(ordered ? "ol" : "ul");
        const startAt = ordered ? Number(item.exec(line)[1]) : 1;
        if (ordered && startAt !== 1) list.setAttribute("start", String(startAt));
        while (i < src.length && item.test(src[i]) && Boolean(item.exec(src[i])[1]) === ordered) {
          const li = el("li");
          inline(src[i].replace(item, ""), li);
          list.appendChild(li);
          i++;
        }
        out.appendChild(list);
        continue;
      }
      if (/^\s*>/.test(line)) {
        const quoted = [];
        while (i < src.length && /^\s*>/.test(src[i])) quoted.push(src[i++].replace(/^\s*>\s?/, ""));
        const q = el("blockquote");
        q.appendChild(markdown(quoted.join("\n")));
        out.appendChild(q);
        continue;
      }
      if (!line.trim()) { i++; continue; }
      const para = [];
      while (i < src.length && src[i].trim() && !/^\s*```/.test(src[i]) && !/^#{1,6}\s/.test(src[i]) &&
             !item.test(src[i]) && !/^\s*>/.test(src[i])) para.push(src[i++]);
      const p = el("p");
      lines(p, para);
      out.appendChild(p);
    }
    return out;
  }

  // ---------- the conversation ----------

  const state = { messages: [], controller: null, models: [] };

  function setChat(s) { document.body.dataset.chat = s; }
  function showError(text) {
    const e = $("chat-error");
    e.textContent = text || "";
    e.hidden = !text;
  }

  function addMessage(role, text) {
    const li = el("li", { class: "msg msg-" + role, "data-role": role });
    li.appendChild(el("span", { class: "who" }, role === "user" ? "You" : "Assistant"));
    const body = el("div", { class: "body" });
    if (role === "user") lines(body, String(text).split("\n"));
    else body.appendChild(markdown(text));
    li.appendChild(body);
    $("chat-log").appendChild(li);
    li.scrollIntoView({ block: "end" });
    return li;
  }

  function draw(li, text, reasoning) {
    const body = li.querySelector(".body");
    clear(body);
    if (reasoning) {
      const d = el("details", { class: "reasoning" });
      d.appendChild(el("summary", {}, "Reasoning"));
      d.appendChild(markdown(reasoning));
      body.appendChild(d);
    }
    body.appendChild(markdown(text));
  }

  function figures(run) {
    const parts = [];
    const n = run.usage && isNum(run.usage.completion_tokens) ? run.usage.completion_tokens : run.chunks;
    parts.push(n + (run.usage ? "" : " (about)") + " tokens");
    if (n >= 2 && run.tLast > run.tFirst) {
      parts[0] += ", " + ((n - 1) / ((run.tLast - run.tFirst) / 1000)).toFixed(1) + " tokens/s";
    }
    if (run.tFirst !== null) parts.push("first token after " + ((run.tFirst - run.t0) / 1000).toFixed(2) + " s");
    if (run.usage) {
      const details = run.usage.prompt_tokens_details || {};
      parts.push("prompt " + run.usage.prompt_tokens + " tokens, " +
        (isNum(details.cached_tokens) ? details.cached_tokens : "?") + " cached");
    }
    return parts.join("; ");
  }

  async function send(e) {
    if (e) e.preventDefault();
    const input = $("chat-input");
    const text = input.value.trim();
    if (!text || state.controller) return;
    showError("");
    state.messages.push({ role: "user", content: text });
    addMessage("user", text);
    input.value = "";
    const system = $("chat-system").value.trim();
    const temperature = Number($("chat-temperature").value);
    const maxTokens = Math.round(Number($("chat-max-tokens").value));
    const body = {
      messages: (system ? [{ role: "system", content: system }] : []).concat(state.messages),
      stream: true, stream_options: { include_usage: true },
    };
    if ($("chat-model").value) body.model = $("chat-model").value;
    if (isNum(temperature)) body.temperature = temperature;
    if (isNum(maxTokens) && maxTokens > 0) body.max_tokens = maxTokens;
    const li = addMessage("assistant", "");
    li.dataset.state = "streaming";
    const run = { t0: performance.now(), tFirst: null, tLast: null, chunks: 0, usage: null, text: "", reasoning: "" };
    const controller = new AbortController();
    state.controller = controller;
    $("chat-stop").disabled = false;
    $("chat-send").disabled = true;
    setChat("streaming");
    $("chat-stats").textContent = "Waiting for the first token\u2026";
    let drawn = false;
    const redraw = () => { drawn = false; draw(li, run.text, run.reasoning); li.dataset.chunks = String(run.chunks); };
    let how = "done";
    try {
      const res = await fetch("/v1/chat/completions", { method: "POST", headers: G.headers(true),
        body: JSON.stringify(body), signal: controller.signal });
      if (!res.ok) {
        let data = null;
        try { data = await res.json(); } catch (_) { data = null; }
        throw new G.ApiError(res, data);
      }
      await G.readEvents(res, (payload) => {
        if (payload === "[DONE]") return;
        let d;
        try { d = JSON.parse(payload); } catch (_) { return; }
        if (d.error) throw new Error(d.error.message || String(d.error));
        if (d.usage) run.usage = d.usage;
        for (const c of d.choices || []) {
          const delta = c.delta || {};
          if (typeof delta.content === "string" && delta.content) run.text += delta.content;
          else if (typeof delta.reasoning_content === "string" && delta.reasoning_content) run.reasoning += delta.reasoning_content;
          else continue;
          run.chunks++;
          const now = performance.now();
          if (run.tFirst === null) run.tFirst = now;
          run.tLast = now;
        }
        if (!drawn) { drawn = true; window.requestAnimationFrame(redraw); }
        if (run.chunks) $("chat-stats").textContent = figures(run);
      });
    } catch (err) {
      if (err && err.name === "AbortError") how = "stopped";
      else { how = "error"; showError("The chat failed: " + err.message); }
    } finally {
      state.controller = null;
      redraw();
      li.dataset.state = how;
      if (how === "stopped") li.appendChild(el("p", { class: "stopped" }, "(stopped)"));
      if (run.text || run.reasoning) state.messages.push({ role: "assistant", content: run.text });
      $("chat-stats").textContent = run.chunks || run.usage ? figures(run) + (how === "stopped" ? "; stopped" : "")
        : (how === "stopped" ? "Stopped before the first token." : "");
      $("chat-stop").disabled = true;
      $("chat-send").disabled = false;
      setChat(how);
      $("chat-input").focus();
    }
  }

  function stop() { if (state.controller) state.controller.abort(); }

  function newChat() {
    stop();
    state.messages = [];
    clear($("chat-log"));
    $("chat-stats").textContent = "";
    showError("");
    setChat("idle");
    $("chat-input").focus();
  }

  // The loaded models first (the first selected), then the others, which answer only where they load on demand.
  function fillModels(models) {
    const sel = $("chat-model");
    const current = sel.value;
    const loaded = models.filter((m) => m.state === "loaded").map((m) => m.name);
    const others = models.filter((m) => m.state !== "loaded").map((m) => m.name);
    const key = loaded.join(",") + "|" + others.join(",");
    if (sel.dataset.key === key) return;
    sel.dataset.key = key;
    clear(sel);
    for (const n of loaded) sel.appendChild(el("option", { value: n }, n));
    for (const n of others) sel.appendChild(el("option", { value: n }, n + " (not loaded)"));
    if ([...loaded, ...others].includes(current)) sel.value = current;
    $("chat-none").hidden = loaded.length > 0;
  }

  function start() {
    $("chat-form").addEventListener("submit", send);
    $("chat-stop").addEventListener("click", stop);
    $("chat-new").addEventListener("click", newChat);
    $("chat-input").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) send(e);
      else if (e.key === "Escape") stop();
    });
    document.addEventListener("gguf:models", (e) => fillModels(e.detail || []));
    setChat("idle");
  }

  window.GGUF_MARKDOWN = markdown;  // the page tests render with it directly too

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
