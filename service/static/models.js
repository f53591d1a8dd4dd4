// The Models view: what is loaded (state, memory llama.cpp allocated beside the plan's prediction per device, slots,
// keep-alive left, prompt-cache use: GET /api/models), what is available, load and unload (POST /api/models/load and
// /unload, admin routes where keys are set), and a pull from Hugging Face with its progress streamed
// (POST /api/models/pull with stream: true, server-sent events) and a cancel (POST /api/models/pull/cancel).
// Each refresh tells the other views which models there are (the "gguf:models" event).
"use strict";

(function () {
  const G = window.GGUF;
  const { $, el, clear, isNum, fmtMiB, fmtBytes, fmtDuration } = G;
  const POLL_MS = 2000;

  const state = { models: [], downloads: [], busy: new Set(), pulling: null, timer: null, refreshing: false };

  function status(text) { $("models-status").textContent = text || ""; }
  function showError(text) {
    const e = $("models-error");
    e.textContent = text || "";
    e.hidden = !text;
  }
  function bump(attr) {
    const b = document.body;
    b.dataset[attr] = String(Number(b.dataset[attr] || "0") + 1);
  }

  // ---------- the listing ----------

  async function refresh() {
    if (state.refreshing) return;
    state.refreshing = true;
    try {
      const data = await G.api("/api/models");
      state.models = Array.isArray(data.models) ? data.models : [];
      state.downloads = Array.isArray(data.downloads) ? data.downloads : [];
      render();
      document.dispatchEvent(new CustomEvent("gguf:models", { detail: state.models }));
      if ($("models-error").dataset.from === "refresh") showError("");
    } catch (err) {
      showError("Could not list the models: " + err.message);
      $("models-error").dataset.from = "refresh";
    } finally {
      state.refreshing = false;
      bump("modelsRenders");
    }
  }

  function isLoaded(m) { return m.state && m.state !== "unloaded"; }

  function memoryCell(m) {
    // Per device: what llama.cpp allocated beside what the plan predicted (service.residency views: memory).
    const td = el("td", { "data-field": "memory" });
    const rows = Array.isArray(m.memory) ? m.memory : [];
    if (!rows.length) { td.textContent = "\u2013"; return td; }
    const ul = el("ul", { class: "plain" });
    for (const d of rows) {
      ul.appendChild(el("li", { "data-device": d.device },
        d.device + ": " + fmtMiB(d.allocated_mib) + " MiB allocated, " + fmtMiB(d.predicted_mib) + " predicted"));
    }
    td.appendChild(ul);
    return td;
  }

  function slotsText(m) {
    const chosen = m.plan && m.plan.chosen ? m.plan.chosen : {};
    const n = chosen.n_seq_max;
    const busy = isNum(m.in_flight) ? m.in_flight : 0;
    return isNum(n) ? busy + " of " + n + " busy" : String(busy) + " busy";
  }

  function keepAliveText(m) {
    if (m.pinned) return "pinned";
    if (isNum(m.expires_in_s)) return fmtDuration(m.expires_in_s) + " left";
    if (m.keep_alive_s === -1 || m.keep_alive_s === null || m.keep_alive_s === undefined) return "never unloaded";
    return m.busy ? "busy" : "\u2013";
  }

  function cacheText(m) {
    const pc = m.prompt_cache || {};
    const h = pc.holds || {};
    if (!isNum(h.budget_bytes)) return pc.budget_mib === 0 ? "off" : "\u2013";
    return fmtBytes(h.bytes) + " of " + fmtBytes(h.budget_bytes) + ", " + (h.entries || 0) + " prompts, " +
      (h.hits || 0) + " hits";
  }

  // What has the keyboard's focus among the rows redrawn every poll (a model's button, a download's cancel), so that
  // the button drawn in its place gets it back: a keyboard user's place survives the refresh.
  function focusedKey() {
    const f = document.activeElement;
    if (!f || f.tagName !== "BUTTON") return null;
    const row = f.closest("[data-model], [data-download]");
    if (!row) return null;
    return { model: row.dataset.model, download: row.dataset.download, action: f.dataset.action || "" };
  }

  function refocus(key) {
    if (!key || (document.activeElement && document.activeElement !== document.body)) return;
    const row = key.model !== undefined ? '[data-model="' + CSS.escape(key.model) + '"]'
      : '[data-download="' + CSS.escape(key.download) + '"]';
    const b = document.querySelector(row + " button" + (key.action ? '[data-action="' + key.action + '"]' : ""));
    if (b) b.focus();
  }

  function render() {
    const key = focusedKey();
    draw();
    refocus(key);
  }

  function draw() {
    const tbody = $("loaded-table").tBodies[0];
    clear(tbody);
    const loaded = state.models.filter(isLoaded);
    for (const m of loaded) {
      const tr = el("tr", { "data-model": m.name, "data-state": m.state });
      const th = el("th", { scope: "row" }, m.name);
      if (Array.isArray(m.aliases) && m.aliases.length) th.appendChild(el("span", { class: "sub" }, " (" + m.aliases.join(", ") + ")"));
      tr.appendChild(th);
      tr.appendChild(el("td", { "data-field": "state" }, m.state + (m.error ? ": " + m.error : "")));
      tr.appendChild(memoryCell(m));
      tr.appendChild(el("td", { "data-field": "slots" }, slotsText(m)));
      tr.appendChild(el("td", { "data-field": "keep_alive" }, keepAliveText(m)));
      tr.appendChild(el("td", { "data-field": "prompt_cache" }, cacheText(m)));
      const act = el("td");
      if (m.state === "loaded") act.appendChild(actionButton("Unload", m.name));
      tr.appendChild(act);
      tbody.appendChild(tr);
    }
    $("loaded-none").hidden = loaded.length > 0;

    const ul = $("available");
    clear(ul);
    const rest = state.models.filter((m) => !isLoaded(m));
    for (const m of rest) {
      const li = el("li", { "data-model": m.name });
      li.appendChild(el("span", { class: "name" }, m.name));
      li.appendChild(el("span", { class: "sub" }, " " + (m.origin || "") +
        (Array.isArray(m.aliases) && m.aliases.length ? ", aliases " + m.aliases.join(", ") : "")));
      li.appendChild(actionButton("Load", m.name));
      ul.appendChild(li);
    }
    $("available-none").hidden = rest.length > 0;
    renderDownloads();
  }

  function actionButton(verb, name) {
    const b = el("button", { type: "button", class: "action", "data-action": verb.toLowerCase(),
      "aria-label": verb + " " + name }, state.busy.has(name) ? verb + "ing\u2026" : verb);
    b.disabled = state.busy.has(name);
    b.addEventListener("click", () => act(verb.toLowerCase(), name));
    return b;
  }

  // Load or unload: the service answers when it is done; meanwhile the button says so.
  async function act(verb, name) {
    state.busy.add(name);
    render();
    showError("");
    status((verb === "load" ? "Loading " : "Unloading ") + name + "\u2026");
    try {
      await G.api("/api/models/" + verb, { model: name });
      status((verb === "load" ? "Loaded " : "Unloaded ") + name + ".");
    } catch (err) {
      status("");
      showError((verb === "load" ? "Loading " : "Unloading ") + name + " failed: " + err.message);
      $("models-error").dataset.from = "action";
    } finally {
      state.busy.delete(name);
      await refresh();
      const again = document.querySelector('[data-model="' + CSS.escape(name) + '"] button.action');
      if (again) again.focus();
    }
  }

  // ---------- downloads started elsewhere (another tab, curl): listed with their progress and a cancel ----------

  function renderDownloads() {
    const ul = $("downloads");
    clear(ul);
    const mine = state.pulling ? state.pulling.id : null;
    const others = state.downloads.filter((d) => d.id !== mine && d.state === "downloading");
    for (const d of others) {
      const li = el("li", { "data-download": d.id });
      li.appendChild(el("span", {}, d.repo_id + "/" + d.filename + ": " + progressWords(d) + " "));
      const b = el("button", { type: "button", "data-action": "cancel", "aria-label": "Cancel the download of " +
        d.filename }, "Cancel");
      b.addEventListener("click", () => cancel(d));
      li.appendChild(b);
      ul.appendChild(li);
    }
    $("downloads-section").hidden = others.length === 0;
  }

  function progressWords(d) {
    const parts = [fmtBytes(d.bytes_done) + " of " + (d.bytes_total ? fmtBytes(d.bytes_total) : "?")];
    if (isNum(d.progress)) parts[0] += " (" + Math.floor(d.progress * 100) + "%)";
    if (isNum(d.rate_bytes_per_s)) parts.push(fmtBytes(d.rate_bytes_per_s) + "/s");
    if (isNum(d.eta_s)) parts.push(fmtDuration(d.eta_s) + " left");
    return parts.join(", ");
  }

  // ---------- pull ----------

  // "hf.co/OWNER/REPO:QUANT", "hf.co/OWNER/REPO/FILE.gguf", or "OWNER/REPO FILE.gguf" (the repo and the file).
  function pullBody(text) {
    const t = text.trim();
    const two = t.split(/\s+/);
    if (two.length === 2 && two[1].endsWith(".gguf") && !two[0].includes(":")) {
      return { repo_id: two[0].replace(/^(https?:\/\/)?(hf\.co|huggingface\.co)\//, ""), filename: two[1] };
    }
    return { model: /^(https?:\/\/)?(hf\.co|huggingface\.co)\//.test(t) ? t : "hf.co/" + t };
  }

  function showPull(d) {
    state.pulling = d;
    const box = $("pull-progress");
    box.hidden = false;
    box.dataset.state = d.state;
    box.dataset.bytesDone = String(d.bytes_done || 0);
    $("pull-file").textContent = d.repo_id + "/" + d.filename + (d.files > 1 ? " (file " + (d.file_index + 1) +
      " of " + d.files + ")" : "");
    const bar = $("pull-bar");
    if (isNum(d.progress)) bar.value = d.progress;
    else bar.removeAttribute("value");
    const words = { done: "Done: ", failed: "Failed: ", cancelled: "Cancelled: " }[d.state] || "";
    $("pull-figures").textContent = words + (d.state === "failed" ? (d.error || "") :
      d.state === "cancelled" ? "stopped at " + fmtBytes(d.bytes_done) + "; the partial file was removed." :
        progressWords(d));
    $("pull-cancel").disabled = d.state !== "downloading";
  }

  async function pull(e) {
    e.preventDefault();
    const text = $("pull-ref").value;
    if (!text.trim()) { showError("Name a Hugging Face GGUF: hf.co/OWNER/REPO:QUANT or hf.co/OWNER/REPO/FILE.gguf."); return; }
    showError("");
    $("pull-start").disabled = true;
    $("pull-progress").hidden = false;
    $("pull-progress").dataset.state = "starting";
    $("pull-figures").textContent = "Asking the hub\u2026";
    $("pull-cancel").disabled = true;
    let last = null;
    try {
      const res = await fetch("/api/models/pull", { method: "POST", headers: G.headers(true),
        body: JSON.stringify(Object.assign(pullBody(text), { stream: true })) });
      if (!res.ok) {
        let data = null;
        try { data = await res.json(); } catch (_) { data = null; }
        throw new G.ApiError(res, data);
      }
      await G.readEvents(res, (payload) => {
        let d;
        try { d = JSON.parse(payload); } catch (_) { return; }
        last = d;
        showPull(d);
        bump("pullEvents");
      });
      if (last && last.state === "done") status("Pulled " + last.name + ": load it under \u201cAvailable\u201d.");
    } catch (err) {
      $("pull-progress").dataset.state = "failed";
      $("pull-figures").textContent = "";
      showError("The pull failed: " + err.message);
      $("models-error").dataset.from = "pull";
    } finally {
      $("pull-start").disabled = false;
      $("pull-cancel").disabled = true;
      state.pulling = null;
      refresh();
    }
  }

  async function cancel(d) {
    try {
      await G.api("/api/models/pull/cancel", { repo_id: d.repo_id, filename: d.filename, revision: d.revision });
      status("Cancelled the download of " + d.filename + ".");
    } catch (err) {
      showError("Cancelling failed: " + err.message);
      $("models-error").dataset.from = "action";
    }
    refresh();
  }

  // ---------- start: polled while the view shows ----------

  function onView(view) {
    if (state.timer !== null) { clearInterval(state.timer); state.timer = null; }
    if (view === "models") {
      refresh();
      state.timer = setInterval(refresh, POLL_MS);
    }
  }

  function start() {
    $("pull-form").addEventListener("submit", pull);
    $("pull-cancel").addEventListener("click", () => { if (state.pulling) cancel(state.pulling); });
    $("models-refresh").addEventListener("click", refresh);
    document.addEventListener("gguf:view", (e) => onView(e.detail));
    onView(G.currentView());
    if (G.currentView() !== "models") refresh();  // the other views want the list once
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
