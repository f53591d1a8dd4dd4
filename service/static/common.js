// What the page's views share (loaded first): the API key of this tab, requests to the API with it, elements built
// from text only, figures in words, server-sent events read from a fetch, and the switch between the views
// (Plan, Models, Chat: links to #plan, #models, #chat). No framework, no build step: the CSP allows these files only.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);

  function isNum(x) { return typeof x === "number" && Number.isFinite(x); }

  // An element with attributes and text; text is always text (textContent), never markup.
  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v !== null && v !== undefined && v !== false) node.setAttribute(k, v === true ? "" : String(v));
    }
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }

  // With API keys set (GGUF_API_KEYS), the API wants one: typed once under "API key", kept for this tab only.
  function apiKey() {
    try { return window.sessionStorage.getItem("gguf-api-key") || ""; } catch (_) { return ""; }
  }

  function headers(json) {
    const h = {};
    if (json) h["content-type"] = "application/json";
    const key = apiKey();
    if (key) h["authorization"] = "Bearer " + key;
    return h;
  }

  // An API error in words: the service's own message (the OpenAI envelope), and what to do for 401 and 403.
  function errorText(res, data) {
    const msg = data && data.error ? (typeof data.error === "string" ? data.error : data.error.message) : null;
    if (res.status === 401) return "This service needs an API key: enter it under \u201cAPI key\u201d above.";
    if (res.status === 403) {
      return "This needs an admin key (GGUF_ADMIN_KEYS); the key entered may only chat and read" +
        (msg ? " (the service: " + msg + ")" : "") + ".";
    }
    return msg || (res.status + " " + res.statusText);
  }

  class ApiError extends Error {
    constructor(res, data) {
      super(errorText(res, data));
      this.status = res.status;
      this.code = data && data.error && data.error.code ? data.error.code : null;
    }
  }

  // GET (no body) or POST a JSON body; the answer's JSON, or an ApiError with the service's message.
  async function api(path, body, init) {
    const opts = Object.assign(body === undefined ? { headers: headers(false) }
      : { method: "POST", headers: headers(true), body: JSON.stringify(body) }, init || {});
    const res = await fetch(path, opts);
    let data = null;
    try { data = await res.json(); } catch (_) { data = null; }
    if (!res.ok) throw new ApiError(res, data);
    return data;
  }

  // A streamed answer (server-sent events): ``onData`` gets each ``data:`` payload as a string, in order. Ends when
  // the stream does; an aborted fetch rejects with its AbortError.
  async function readEvents(res, onData) {
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n")) >= 0) {
        const line = buf.slice(0, cut).replace(/\r$/, "");
        buf = buf.slice(cut + 1);
        if (line.startsWith("data:")) onData(line.slice(5).replace(/^ /, ""));
      }
    }
    if (buf.startsWith("data:")) onData(buf.slice(5).replace(/^ /, ""));
  }

  // ---------- figures in words ----------

  function fmtMiB(x) { return isNum(x) ? x.toFixed(2) : "\u2013"; }

  function fmtBytes(n) {
    if (!isNum(n)) return "?";
    if (n >= 1 << 30) return (n / (1 << 30)).toFixed(2) + " GiB";
    return (n / (1 << 20)).toFixed(1) + " MiB";
  }

  function fmtDuration(s) {
    if (!isNum(s)) return "\u2013";
    s = Math.max(0, Math.round(s));
    if (s < 60) return s + " s";
    if (s < 3600) return Math.floor(s / 60) + " min " + (s % 60) + " s";
    return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
  }

  // ---------- views: #plan, #models, #chat ----------

  const VIEWS = ["plan", "models", "chat"];

  function currentView() {
    const h = (window.location.hash || "").replace(/^#/, "");
    return VIEWS.includes(h) ? h : "plan";
  }

  function showView() {
    const now = currentView();
    for (const v of VIEWS) {
      const section = $(v);
      if (section) section.hidden = v !== now;
      const link = $("view-" + v);
      if (link) {
        if (v === now) link.setAttribute("aria-current", "page");
        else link.removeAttribute("aria-current");
      }
    }
    document.body.dataset.view = now;
    document.dispatchEvent(new CustomEvent("gguf:view", { detail: now }));
  }

  window.addEventListener("hashchange", showView);

  window.GGUF = Object.freeze({
    $, isNum, el, clear, apiKey, headers, api, ApiError, errorText, readEvents, fmtMiB, fmtBytes, fmtDuration,
    currentView, showView,
  });

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", showView);
  else showView();
})();
