// The plan page: asks POST /api/dry-run and draws the answer (bars to scale, with each loaded model's share,
// the cache-type table, the partial-offload candidates, memory against context). No framework, no build step, no inline script: the CSP allows this file only.
// Fields of the plan are read defensively: a missing one is not shown.
"use strict";

(function () {
  const SVG_NS = "http://www.w3.org/2000/svg";
  const $ = (id) => document.getElementById(id);

  const state = {
    live: null,       // this machine's cards, from the first plan made without hypothetical cards
    hypo: [],         // hypothetical cards: {name, free_mib, total_mib}
    seq: 0,           // newest redraw; older answers are dropped
    chartSeq: 0,
    chartKey: null,
    chartData: null,  // {key, ns, types, series: {type: [mib|null]}, where}
    largest: null,
    plan: null,
  };

  // Bar segments, in the order memory is drawn, with the words the legend and labels use.
  const SEGMENTS = [
    { kind: "used", name: "in use by others" },
    { kind: "resident", name: "another loaded model" },
    { kind: "weights", name: "weights" },
    { kind: "kv", name: "KV cache" },
    { kind: "compute", name: "compute buffer" },
    { kind: "allowance", name: "allowance" },
    { kind: "draft", name: "draft model" },
    { kind: "projector", name: "vision projector" },
    { kind: "free", name: "free" },
    { kind: "over", name: "over the memory" },
  ];

  const VERDICT_WORDS = {
    cpu: "Runs on the CPU: no cards, the whole model in host memory.",
    one_card: "Fits on one card.",
    split: "Fits split across several cards.",
    partial_offload: "Fits only partly on the cards: some layers stay in host memory.",
    refused: "Does not fit: a load would be refused.",
  };
  const VERDICT_SHORT = {
    cpu: "CPU", one_card: "one card", split: "split", partial_offload: "partial offload", refused: "does not fit",
  };

  // ---------- small helpers ----------

  function isNum(x) { return typeof x === "number" && Number.isFinite(x); }
  function fmtMiB(x) { return isNum(x) ? x.toFixed(2) : "–"; }
  function fmtInt(x) { return isNum(x) ? String(Math.round(x)) : "–"; }
  function sum(xs) { return xs.reduce((a, b) => a + (isNum(b) ? b : 0), 0); }

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v !== null && v !== undefined && v !== false) node.setAttribute(k, v === true ? "" : String(v));
    }
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function sv(tag, attrs, text) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v !== null && v !== undefined) node.setAttribute(k, String(v));
    }
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }

  function layerRanges(layers) {
    if (!Array.isArray(layers) || layers.length === 0) return "";
    const xs = layers.filter(isNum).slice().sort((a, b) => a - b);
    const out = [];
    let start = xs[0], prev = xs[0];
    for (const x of xs.slice(1).concat([null])) {
      if (x !== null && x === prev + 1) { prev = x; continue; }
      out.push(start === prev ? String(start) : start + "–" + prev);
      start = prev = x;
    }
    return out.join(", ");
  }

  function setStatus(text) { $("status").textContent = text; }
  function showError(text) {
    const e = $("error");
    e.textContent = text || "";
    e.hidden = !text;
  }
  function bump(attr) {
    const b = document.body;
    b.dataset[attr] = String(Number(b.dataset[attr] || "0") + 1);
  }

  // With API keys set (GGUF_API_KEYS), the API wants one: typed once, kept for this tab only.
  function apiKey() {
    try { return window.sessionStorage.getItem("gguf-api-key") || ""; } catch (_) { return ""; }
  }

  async function api(path, body) {
    const headers = {};
    if (body !== undefined) headers["content-type"] = "application/json";
    const key = apiKey();
    if (key) headers["authorization"] = "Bearer " + key;
    const init = body === undefined ? { headers } : { method: "POST", headers, body: JSON.stringify(body) };
    const res = await fetch(path, init);
    if (res.status === 401) {
      throw new Error("This service needs an API key: enter it under \u201cAPI key\u201d above.");
    }
    let data = null;
    try { data = await res.json(); } catch (_) { data = null; }
    if (!res.ok) {
      const msg = data && data.error && data.error.message ? data.error.message : res.status + " " + res.statusText;
      throw new Error(msg);
    }
    return data;
  }

  function wireApiKey() {
    const input = $("api-key");
    if (!input) return;
    input.value = apiKey();
    input.addEventListener("change", () => {
      try { window.sessionStorage.setItem("gguf-api-key", input.value.trim()); } catch (_) { /* storage off */ }
      window.location.reload();
    });
  }
  wireApiKey();

  // ---------- the request ----------

  function declaredGpus() {
    if (state.hypo.length === 0) return null;
    const live = $("keep-live").checked && Array.isArray(state.live)
      ? state.live.map((d) => ({ name: d.name, free_mib: d.free_mib, total_mib: d.total_mib }))
      : [];
    return live.concat(state.hypo.map((c) => ({ name: c.name, free_mib: c.free_mib, total_mib: c.total_mib })));
  }

  // The body without cache type and context: what the chart's samples share.
  function commonBody() {
    const body = { model: $("model").value };
    const fa = $("flash-attn").value;
    if (fa) body.flash_attn = fa;
    const gpu = $("gpu").value;
    if (gpu === "all") body.gpu = "all";
    else if (gpu !== "auto" && gpu !== "") body.gpu = Number(gpu);
    const gpus = declaredGpus();
    if (gpus) body.gpus = gpus;
    return body;
  }

  function ctxValue() {
    const n = Math.round(Number($("ctx-number").value));
    return isNum(n) && n >= 1 ? n : 4096;
  }

  // ---------- redraw ----------

  async function redraw() {
    const seq = ++state.seq;
    if (!$("model").value) return;
    showError("");
    setStatus("Asking the dry-run…");
    document.body.dataset.state = "loading";
    const body = commonBody();
    const ct = $("cache-type").value;
    if (ct) body.cache_type = ct;
    try {
      const largest = await api("/api/dry-run", body);
      let plan = largest;
      if (!$("ctx-largest").checked) plan = await api("/api/dry-run", Object.assign({}, body, { n_ctx: ctxValue() }));
      if (seq !== state.seq) return;
      if (state.live === null && !body.gpus) state.live = Array.isArray(largest.devices) ? largest.devices : [];
      state.largest = largest;
      state.plan = plan;
      syncControls(largest, plan);
      renderVerdict(plan);
      renderBars(plan);
      renderCandidates(plan);
      renderCacheTable(largest, plan);
      document.body.dataset.state = "ready";
      bump("renders");
      setStatus("Plan updated for " + body.model + ".");
      drawChart(commonBody(), largest, plan);
    } catch (err) {
      if (seq !== state.seq) return;
      document.body.dataset.state = "error";
      showError("The dry-run failed: " + err.message);
      setStatus("");
      bump("renders");
    }
  }

  let debounceTimer = null;
  function redrawSoon() {
    if (debounceTimer !== null) clearTimeout(debounceTimer);
    debounceTimer = setTimeout(() => { debounceTimer = null; redraw(); }, 250);
  }

  function syncControls(largest, plan) {
    const chosen = plan.chosen || {};
    // Cache types: the ones the plan reports.
    const sel = $("cache-type");
    const types = (largest.cache_types || []).map((c) => c.cache_type).filter(Boolean);
    const have = Array.from(sel.options).map((o) => o.value);
    if (types.join(",") !== have.join(",")) {
      clear(sel);
      for (const t of types) sel.appendChild(el("option", { value: t }, t));
    }
    if (chosen.cache_type) sel.value = chosen.cache_type;

    // Context slider: up to the model's training context.
    const model = plan.model || {};
    const range = $("ctx-range"), number = $("ctx-number");
    if (isNum(model.n_ctx_train)) {
      range.max = String(model.n_ctx_train);
      number.max = String(model.n_ctx_train);
    }
    if ($("ctx-largest").checked && isNum(chosen.n_ctx) && chosen.n_ctx > 0) {
      range.value = String(chosen.n_ctx);
      number.value = String(chosen.n_ctx);
    }

    // The card choice: auto, all, or one card by index.
    const gsel = $("gpu");
    const current = gsel.value;
    const devices = Array.isArray(plan.devices) ? plan.devices : [];
    // A device by its position in plan.devices (what the plan's gpus name): a worker's device and a card both
    // number from 0 by index.
    const wanted = ["auto", "all"].concat(devices.map((d, i) => String(i)));
    const now = Array.from(gsel.options).map((o) => o.value);
    if (wanted.join(",") !== now.join(",")) {
      clear(gsel);
      gsel.appendChild(el("option", { value: "auto" }, "auto (one card if one holds it)"));
      gsel.appendChild(el("option", { value: "all" }, "all cards"));
      devices.forEach((d, i) => {
        const what = d.host ? d.label : "card " + d.index + ": " + (d.name || d.label);
        gsel.appendChild(el("option", { value: String(i) }, what));
      });
      gsel.value = wanted.includes(current) ? current : "auto";
    }
  }

  // ---------- verdict ----------

  function renderVerdict(plan) {
    const v = $("verdict");
    const verdict = plan.verdict;
    let words = VERDICT_WORDS[verdict] || ("Verdict: " + verdict);
    const chosen = plan.chosen || {};
    const devices = Array.isArray(plan.devices) ? plan.devices : [];
    const used = Array.isArray(chosen.gpus) ? chosen.gpus : [];
    const names = used.map((i) => {
      const d = devices[i];
      return d ? (d.host ? d.label : d.label + " " + d.name) : ("device " + i);
    });
    if ((verdict === "one_card" || verdict === "split" || verdict === "partial_offload") && names.length) {
      words += " Cards: " + names.join(", ") + ".";
    }
    v.textContent = words;
    v.className = "verdict " + (verdict === "refused" ? "refused" : "fits");
    v.dataset.verdict = verdict || "";

    const dl = $("summary");
    clear(dl);
    const model = plan.model || {};
    const est = plan.estimate || {};
    const items = [
      ["model", "Model", model.name ? model.name + (model.quantization ? " (" + model.quantization + ")" : "") : null],
      ["n_ctx", "Context", isNum(chosen.n_ctx) ? fmtInt(chosen.n_ctx) + " tokens" : null],
      ["cache_type", "Cache type", est.type_k ? est.type_k + " / " + est.type_v : chosen.cache_type],
      ["flash_attn", "Flash attention", chosen.flash_attn],
      ["n_gpu_layers", "n_gpu_layers", isNum(chosen.n_gpu_layers) ? String(chosen.n_gpu_layers) : null],
      ["kv_mib", "KV cache", isNum(est.kv_mib) ? fmtMiB(est.kv_mib) + " MiB" : null],
      ["total_mib", "Total", isNum(est.total_mib) ? fmtMiB(est.total_mib) + " MiB" : null],
      ["draft", "Draft model", plan.draft ? plan.draft.name + " on " + plan.draft.device + ", " +
        fmtMiB(plan.draft.total_mib) + " MiB" : (plan.draft_refusal || null)],
      ["projector", "Vision projector", plan.projector ? plan.projector.projector_type + " on " +
        plan.projector.device + ", " + fmtMiB(plan.projector.total_mib) + " MiB" +
        (isNum(plan.projector.tokens_per_image) ? ", " + fmtInt(plan.projector.tokens_per_image) + " tokens an image"
          : isNum(plan.projector.image_max_tokens) ? ", at most " + fmtInt(plan.projector.image_max_tokens) +
            " tokens an image" : "") : null],
      ["n_ctx_train", "Trained context", isNum(model.n_ctx_train) ? fmtInt(model.n_ctx_train) : null],
    ];
    for (const [key, label, value] of items) {
      if (value === null || value === undefined || value === "") continue;
      const row = el("div");
      row.appendChild(el("dt", {}, label));
      row.appendChild(el("dd", { "data-field": key }, value));
      dl.appendChild(row);
    }

    const ul = $("reasons");
    clear(ul);
    const reasons = Array.isArray(plan.reasons) ? plan.reasons : [];
    for (const r of reasons) ul.appendChild(el("li", {}, r));
    ul.hidden = reasons.length === 0;
    renderResidency(plan);
  }

  // Whom the plan was made beside, and whom a load would unload first (the dry-run's residency).
  function renderResidency(plan) {
    const p = $("residency");
    clear(p);
    const r = plan.residency || {};
    const beside = Array.isArray(r.beside) ? r.beside : [];
    const evict = Array.isArray(r.evict) ? r.evict : [];
    const busy = Array.isArray(r.busy) ? r.busy : [];
    const parts = [];
    if (beside.length) parts.push(["beside", "Planned beside the loaded models: " + beside.join(", ") + "."]);
    if (evict.length) {
      parts.push(["evict", "A load would first unload " + evict.join(", ")
        + " (idle, least recently used first: the fewest models that make room)."]);
    }
    if (busy.length) parts.push(["busy", "Only models generating now hold the memory it needs: " + busy.join(", ") + "."]);
    for (const [key, text] of parts) p.appendChild(el("span", { "data-field": key }, text + " "));
    p.hidden = parts.length === 0;
  }

  // ---------- partial-offload candidates ----------

  function renderCandidates(plan) {
    const section = $("candidates-section");
    const tbody = $("candidates-table").tBodies[0];
    clear(tbody);
    const cands = Array.isArray(plan.candidates) ? plan.candidates : [];
    for (const c of cands) {
      const tr = el("tr", { "data-n-gpu-layers": isNum(c.n_gpu_layers) ? c.n_gpu_layers : null });
      tr.appendChild(el("th", { scope: "row" }, c.description || ""));
      tr.appendChild(el("td", { class: "num", "data-field": "n_gpu_layers" }, fmtInt(c.n_gpu_layers)));
      tr.appendChild(el("td", { class: "num", "data-field": "n_cpu_moe" }, fmtInt(c.n_cpu_moe)));
      tr.appendChild(el("td", { class: "num", "data-field": "n_ctx" }, fmtInt(c.n_ctx)));
      tr.appendChild(el("td", { class: "num", "data-field": "gpu_weights_mib" }, fmtMiB(c.gpu_weights_mib)));
      tr.appendChild(el("td", { class: "num", "data-field": "host_weights_mib" }, fmtMiB(c.host_weights_mib)));
      tr.appendChild(el("td", { class: "num", "data-field": "disk_weights_mib" }, fmtMiB(c.disk_weights_mib)));
      tr.appendChild(el("td", { class: "num", "data-field": "decode_tokens_per_s" },
        isNum(c.decode_tokens_per_s) ? c.decode_tokens_per_s.toFixed(2) : "–"));
      tr.appendChild(el("td", { class: "num", "data-field": "prompt_tokens_per_s" },
        isNum(c.prompt_tokens_per_s) ? c.prompt_tokens_per_s.toFixed(1) : "–"));
      tbody.appendChild(tr);
    }
    section.hidden = cands.length === 0;
  }

  // ---------- bars ----------

  function buildLegend() {
    const ul = $("legend");
    clear(ul);
    for (const s of SEGMENTS) {
      const li = el("li");
      const sw = sv("svg", { width: 28, height: 16, viewBox: "0 0 28 16", "aria-hidden": "true", focusable: "false" });
      sw.appendChild(sv("rect", { x: 0, y: 0, width: 28, height: 16, class: "seg seg-" + s.kind }));
      li.appendChild(sw);
      li.appendChild(el("span", {}, s.name));
      ul.appendChild(li);
    }
  }

  // What each model the plan was made beside holds on a device (the dry-run's residency.held_mib), by name.
  function residentsOn(label, plan) {
    const held = plan && plan.residency && plan.residency.held_mib ? plan.residency.held_mib[label] : null;
    if (!held || typeof held !== "object") return [];
    return Object.keys(held).filter((n) => isNum(held[n]) && held[n] > 0).map((n) => ({ model: n, mib: held[n] }));
  }

  // The segments of one device's bar, in MiB: what others use, each loaded model's share, then what this plan
  // puts there, then free. The plan's free memory is what is left beside the loaded models.
  function segmentsOf(dev, est, plan) {
    const total = isNum(dev.total_mib) ? dev.total_mib : 0;
    const free = isNum(dev.free_mib) ? dev.free_mib : total;
    const segs = [];
    const usedByOthers = Math.max(0, total - free);
    const residents = residentsOn(dev.label, plan);
    const residentMiB = Math.min(usedByOthers, sum(residents.map((r) => r.mib)));
    // A card that cannot report its free memory (free_memory "unreported"): what is not free is the plan's margin.
    const unread = dev.free_memory === "unreported";
    if (usedByOthers - residentMiB > 0) {
      segs.push({ kind: "used", mib: usedByOthers - residentMiB, label: unread ? "margin" : "in use" });
    }
    let left = residentMiB;
    for (const r of residents) {
      const mib = Math.min(r.mib, left);
      left -= mib;
      if (mib > 0) segs.push({ kind: "resident", mib, label: r.model, model: r.model });
    }
    let need = 0;
    if (est) {
      const layers = layerRanges(est.layers);
      const parts = [
        ["weights", est.weights_mib, layers ? "weights, layers " + layers : "weights"],
        ["kv", sum([est.kv_mib, est.state_mib]), est.state_mib ? "KV + state" : "KV"],
        ["compute", sum([est.compute_mib, est.output_mib]), "compute"],
        ["allowance", sum([est.allowance_mib, est.gpu_pool_mib]), "allowance"],
        ["draft", est.draft_model_mib, "draft model"],
        ["projector", est.projector_mib, "vision projector"],
      ];
      for (const [kind, mib, label] of parts) {
        if (isNum(mib) && mib > 0) { segs.push({ kind, mib, label }); need += mib; }
      }
      if (isNum(est.total_mib)) need = est.total_mib;
    }
    const freeAfter = free - need;
    if (freeAfter > 0) segs.push({ kind: "free", mib: freeAfter, label: "free" });
    return { segs, total, free, need, freeAfter, usedByOthers, extent: Math.max(total, usedByOthers + need) };
  }

  function drawBar(title, sub, dev, est, scaleMiB, note, plan) {
    const info = segmentsOf(dev, est, plan);
    const W = 1000, H = 62, y = 6, h = 36;
    const k = scaleMiB > 0 ? W / scaleMiB : 0;
    const fig = el("figure", { class: "bar", "data-device": dev.label || "", "data-name": dev.name || "" });
    const h3 = el("h3", {}, title + " ");
    if (sub) h3.appendChild(el("span", { class: "sub" }, sub));
    fig.appendChild(h3);

    const words = [title + ": memory " + fmtMiB(info.total) + " MiB"];
    if (info.usedByOthers > 0) {
      words.push(fmtMiB(info.usedByOthers) + (dev.free_memory === "unreported"
        ? " MiB kept back (free memory not reported)" : " MiB in use by others"));
    }
    const svgEl = sv("svg", { viewBox: "0 0 " + W + " " + H, role: "img" });
    let x = 0;
    for (const s of info.segs) {
      const w = Math.max(s.mib * k, s.mib > 0 ? 1.5 : 0);
      svgEl.appendChild(sv("rect", { x: x.toFixed(2), y, width: w.toFixed(2), height: h, class: "seg seg-" + s.kind,
        "data-kind": s.kind, "data-mib": s.mib.toFixed(2), "data-model": s.model || null }));
      const full = s.label + " " + fmtMiB(s.mib);
      const text = full.length * 7.6 + 10 < w ? full : (s.label.length * 7.6 + 10 < w ? s.label : null);
      if (text) {
        const light = s.kind === "free";
        svgEl.appendChild(sv("text", { x: (x + 5).toFixed(2), y: y + h / 2 + 5,
          class: "seg-label" + (light ? " on-light" : "") }, text));
      }
      if (s.kind === "resident") words.push("loaded model " + s.label + " " + fmtMiB(s.mib) + " MiB");
      else if (s.kind !== "used" && s.kind !== "free") words.push(s.label + " " + fmtMiB(s.mib) + " MiB");
      x += w;
    }
    if (est) words.push("this plan needs " + fmtMiB(info.need) + " MiB");
    if (info.freeAfter < 0 && est) {
      const x0 = info.total * k, w = (info.usedByOthers + info.need - info.total) * k;
      if (w > 0) {
        svgEl.appendChild(sv("rect", { x: x0.toFixed(2), y: y - 4, width: w.toFixed(2), height: h + 8,
          class: "seg seg-over", "fill-opacity": "0.55", "data-kind": "over" }));
      }
      words.push("over by " + fmtMiB(-info.freeAfter) + " MiB");
    } else {
      words.push(fmtMiB(Math.max(0, info.freeAfter)) + " MiB free after");
    }
    // The device's memory, like Figure 1's vertical line.
    const ex = info.total * k;
    svgEl.appendChild(sv("line", { x1: ex.toFixed(2), x2: ex.toFixed(2), y1: 0, y2: y + h + 4, class: "edge" }));
    svgEl.appendChild(sv("text", { x: Math.min(ex, W).toFixed(2), y: H - 3, "text-anchor": ex > 120 ? "end" : "start",
      class: "edge-label" }, fmtMiB(info.total) + " MiB"));
    svgEl.setAttribute("aria-label", words.join(", "));
    fig.appendChild(svgEl);

    const p = el("p", { class: "bar-note" });
    if (note) p.textContent = note;
    else if (!est) p.textContent = "Not used by this plan: " + fmtMiB(info.free) + " MiB free.";
    else if (info.freeAfter < 0) {
      p.textContent = "Needs " + fmtMiB(info.need) + " MiB, " + fmtMiB(-info.freeAfter) + " MiB more than is free.";
      p.classList.add("over");
    } else {
      p.textContent = "Needs " + fmtMiB(info.need) + " MiB of " + fmtMiB(info.free) + " MiB free; "
        + fmtMiB(info.freeAfter) + " MiB left.";
    }
    fig.appendChild(p);
    if (dev.free_note) {  // the plan could not read this card's free memory: what it planned on instead
      fig.appendChild(el("p", { class: "bar-note free-note", "data-field": "free_note" }, dev.free_note));
    }
    return fig;
  }

  function renderBars(plan) {
    const box = $("bars");
    clear(box);
    const est = plan.estimate || null;
    const estDevices = est && Array.isArray(est.devices) ? est.devices : [];
    const byLabel = {};
    for (const d of estDevices) byLabel[d.device] = d;
    const devices = Array.isArray(plan.devices) ? plan.devices : [];

    let scale = 0;
    for (const d of devices) scale = Math.max(scale, segmentsOf(d, byLabel[d.label] || null, plan).extent);
    for (const d of devices) {
      const e = byLabel[d.label] || null;
      // A worker's device (ggml-rpc): the host it is on and what it is there; a card: its name and index.
      const sub = d.host ? "(worker " + d.host + ", its " + (d.remote_kind || "device") + ")"
        : "(" + (d.name || "card") + (isNum(d.index) ? ", index " + d.index : "") + ")";
      box.appendChild(drawBar(d.label || d.name, sub, d, e, scale, null, plan));
    }
    const host = plan.host || null;
    const hostEst = byLabel.CPU || null;
    const layersOnHost = hostEst && Array.isArray(hostEst.layers) && hostEst.layers.length > 0;
    if (host && hostEst && (layersOnHost || devices.length === 0)) {
      const hostInfo = segmentsOf(host, hostEst, plan);
      box.appendChild(drawBar("Host memory", "(" + (host.name || "CPU") + ", its own scale)", host, hostEst,
        hostInfo.extent, null, plan));
    } else if (hostEst && isNum(hostEst.total_mib) && hostEst.total_mib > 0) {
      box.appendChild(el("p", { class: "bar-note" }, "Host memory also holds " + fmtMiB(hostEst.total_mib)
        + " MiB (weights kept on the CPU, such as the token embeddings); no layers run there."));
    }
    if (!devices.length && !hostEst) box.appendChild(el("p", { class: "bar-note" }, "No estimate to draw."));

    // The same figures as a table, for screen readers.
    const tbody = $("bars-table").tBodies[0];
    clear(tbody);
    for (const d of estDevices) {
      const tr = el("tr", { "data-device": d.device });
      tr.appendChild(el("th", { scope: "row" }, d.device));
      tr.appendChild(el("td", {}, layerRanges(d.layers) || "none"));
      for (const key of ["weights_mib", "kv_mib", "compute_mib", "output_mib", "allowance_mib", "total_mib", "free_mib",
        "free_after_mib"]) {
        tr.appendChild(el("td", { "data-field": key }, fmtMiB(d[key])));
      }
      tbody.appendChild(tr);
    }
  }

  // ---------- cache-type table ----------

  function renderCacheTable(largest, plan) {
    const tbody = $("cache-table").tBodies[0];
    clear(tbody);
    const chosen = (plan.chosen || {}).cache_type;
    for (const c of largest.cache_types || []) {
      const tr = el("tr", { "data-cache-type": c.cache_type, class: c.cache_type === chosen ? "chosen" : null });
      tr.appendChild(el("th", { scope: "row" }, c.cache_type));
      const fits = c.verdict && c.verdict !== "refused";
      tr.appendChild(el("td", { class: "num", "data-field": "n_ctx" }, fmtInt(c.n_ctx)));
      tr.appendChild(el("td", { class: "num", "data-field": "largest_n_ctx" }, fits ? fmtInt(c.largest_n_ctx || c.n_ctx) : "–"));
      tr.appendChild(el("td", { "data-field": "placement" }, fits && c.placement ? (c.placement.description || "") : "–"));
      tr.appendChild(el("td", { class: "num", "data-field": "decode_tokens_per_s" },
        isNum(c.decode_tokens_per_s) ? c.decode_tokens_per_s.toFixed(1) : "–"));
      tr.appendChild(el("td", { class: "num", "data-field": "kv_mib" }, fmtMiB(c.kv_mib)));
      tr.appendChild(el("td", { class: "num", "data-field": "total_mib" }, fmtMiB(c.total_mib)));
      tr.appendChild(el("td", { "data-field": "sources" }, c.sources ? c.sources.compute : "–"));
      tr.appendChild(el("td", { "data-field": "verdict" }, VERDICT_SHORT[c.verdict] || c.verdict || "–"));
      tr.appendChild(el("td", { "data-field": "error" }, c.error || ""));
      tbody.appendChild(tr);
    }
  }

  // ---------- chart: memory against context ----------

  // Memory the plan needs where it is compared with free memory: on the cards, or in host memory.
  function needOf(plan) {
    const est = plan && plan.estimate;
    if (!est || !Array.isArray(est.devices)) return null;
    const cards = est.devices.filter((d) => d.device !== "CPU");
    if (cards.length) return sum(cards.map((d) => d.total_mib));
    const host = est.devices.find((d) => d.device === "CPU");
    return host && isNum(host.total_mib) ? host.total_mib : null;
  }

  function sampleContexts(nTrain) {
    const ns = [256];
    for (let i = 1; i <= 8; i++) ns.push(Math.max(256, Math.round((nTrain * i) / 8 / 256) * 256));
    return Array.from(new Set(ns)).sort((a, b) => a - b);
  }

  async function pool(jobs, width) {
    const out = new Array(jobs.length);
    let next = 0;
    async function worker() {
      while (next < jobs.length) {
        const i = next++;
        try { out[i] = await jobs[i](); } catch (_) { out[i] = null; }
      }
    }
    await Promise.all(Array.from({ length: Math.min(width, jobs.length) }, worker));
    return out;
  }

  async function drawChart(body, largest, plan) {
    const model = largest.model || {};
    const types = (largest.cache_types || []).map((c) => c.cache_type).filter(Boolean);
    const key = JSON.stringify(body);
    const seq = ++state.chartSeq;
    if (!isNum(model.n_ctx_train) || types.length === 0) {
      renderChart(null, largest, plan);
      return;
    }
    if (state.chartData && state.chartData.key === key) {
      renderChart(state.chartData, largest, plan);
      return;
    }
    // Evenly spaced contexts, and each cache type's largest: the crossing is then a measured point.
    const extra = (largest.cache_types || []).map((c) => c.n_ctx).filter((n) => isNum(n) && n > 0 && n <= model.n_ctx_train);
    const ns = Array.from(new Set(sampleContexts(model.n_ctx_train).concat(extra))).sort((a, b) => a - b);
    setStatus("Plan updated; sampling memory at " + ns.length + " contexts for " + types.length + " cache types…");
    const jobs = [];
    for (const t of types) {
      for (const n of ns) jobs.push(() => api("/api/dry-run", Object.assign({}, body, { cache_type: t, n_ctx: n })));
    }
    const answers = await pool(jobs, 4);
    if (seq !== state.chartSeq) return;
    // Past the largest context the planner keeps the cards full and moves layers to host memory: such a
    // point says nothing about the memory the context needs, so the line stops (unless the plan offloads anyway).
    const comparable = (a) => a && (a.verdict !== "partial_offload" || largest.verdict === "partial_offload");
    const series = {}, notes = {};
    types.forEach((t, ti) => {
      const got = ns.map((_, ni) => answers[ti * ns.length + ni]);
      series[t] = got.map((a) => (comparable(a) ? needOf(a) : null));
      notes[t] = got.map((a) => (a && !comparable(a) ? "layers move to host memory" : null));
    });
    // Where the memory was measured: on the cards when the plans put anything there, else in host memory.
    const onCards = answers.some((a) => a && a.estimate && Array.isArray(a.estimate.devices)
      && a.estimate.devices.some((d) => d.device !== "CPU"));
    state.chartData = { key, ns, types, series, notes, onCards };
    renderChart(state.chartData, largest, plan);
    setStatus("Plan and chart updated for " + body.model + ".");
  }

  function niceStep(span, count) {
    const raw = span / Math.max(1, count);
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * mag >= raw) return m * mag;
    return 10 * mag;
  }

  function ctxLabel(n) {
    if (n >= 1024 && n % 1024 === 0) return n / 1024 + "K";
    return String(n);
  }

  function valueAt(ns, ys, x) {
    for (let i = 1; i < ns.length; i++) {
      if (x <= ns[i] && isNum(ys[i - 1]) && isNum(ys[i])) {
        const t = (x - ns[i - 1]) / (ns[i] - ns[i - 1]);
        return ys[i - 1] + Math.max(0, Math.min(1, t)) * (ys[i] - ys[i - 1]);
      }
    }
    return isNum(ys[ys.length - 1]) ? ys[ys.length - 1] : null;
  }

  function renderChart(data, largest, plan) {
    const svgEl = $("chart");
    clear(svgEl);
    const W = 900, H = 420, L = 72, R = 236, T = 24, B = 52;
    const pw = W - L - R, ph = H - T - B;
    svgEl.appendChild(sv("rect", { x: 0, y: 0, width: W, height: H, class: "bg" }));
    const thead = $("chart-table").tHead, tbody = $("chart-table").tBodies[0];
    clear(thead); clear(tbody);
    if (!data) {
      svgEl.appendChild(sv("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "busy" }, "No data to chart."));
      bump("chartRenders");
      return;
    }
    const nMax = data.ns[data.ns.length - 1];
    const all = [];
    for (const t of data.types) for (const y of data.series[t]) if (isNum(y)) all.push(y);

    // Free memory lines: each card (or the host), and the chosen cards together when there are several.
    const lines = [];
    const devices = Array.isArray(plan.devices) ? plan.devices : [];
    if (data.onCards && devices.length) {
      for (const d of devices) lines.push({ mib: d.free_mib, label: d.label + " free " + fmtMiB(d.free_mib) + " MiB" });
      const used = ((plan.chosen || {}).gpus || []).map((i) => devices[i]).filter(Boolean);
      if (used.length > 1) {
        const s = sum(used.map((d) => d.free_mib));
        lines.push({ mib: s, label: "cards together " + fmtMiB(s) + " MiB" });
      }
    } else if (plan.host && isNum(plan.host.free_mib)) {
      lines.push({ mib: plan.host.free_mib, label: "host free " + fmtMiB(plan.host.free_mib) + " MiB" });
    }
    // A free line far above the curves would flatten them: it is named at the top instead.
    const inView = lines.filter((ln) => isNum(ln.mib) && (!all.length || ln.mib <= Math.max.apply(null, all) * 3));
    const span = all.concat(inView.map((ln) => ln.mib));
    const hi = span.length ? Math.max.apply(null, span) : 1;
    let lo = span.length ? Math.min.apply(null, span) : 0;
    // From zero, unless the figures sit in a narrow band far from it (the first tick then says where it starts).
    if (lo < hi * 0.5) lo = 0;
    const pad = (hi - lo) * 0.12 || hi * 0.1 || 1;
    const step = niceStep(hi + pad - (lo === 0 ? 0 : lo - pad), 6);
    const yMin = lo === 0 ? 0 : Math.floor((lo - pad) / step) * step;
    const yMax = Math.ceil((hi + pad) / step) * step;
    const X = (n) => L + (n / nMax) * pw;
    const Y = (m) => T + ph - ((m - yMin) / (yMax - yMin)) * ph;

    // Grid and axes.
    for (let v = yMin; v <= yMax + 1e-9; v += step) {
      svgEl.appendChild(sv("line", { x1: L, x2: L + pw, y1: Y(v), y2: Y(v), class: "grid" }));
      svgEl.appendChild(sv("text", { x: L - 6, y: Y(v) + 4, "text-anchor": "end", class: "tick" }, Math.round(v)));
    }
    const xt = sampleContexts(nMax).filter((n) => n !== 256);
    for (const n of [0].concat(xt)) {
      svgEl.appendChild(sv("line", { x1: X(n), x2: X(n), y1: T + ph, y2: T + ph + 5, class: "axis" }));
      svgEl.appendChild(sv("text", { x: X(n), y: T + ph + 19, "text-anchor": "middle", class: "tick" }, ctxLabel(n)));
    }
    svgEl.appendChild(sv("line", { x1: L, x2: L + pw, y1: T + ph, y2: T + ph, class: "axis" }));
    svgEl.appendChild(sv("line", { x1: L, x2: L, y1: T, y2: T + ph, class: "axis" }));
    svgEl.appendChild(sv("text", { x: L + pw / 2, y: H - 8, "text-anchor": "middle", class: "axis-title" },
      "context n_ctx (tokens)"));
    svgEl.appendChild(sv("text", { x: 16, y: T + ph / 2, "text-anchor": "middle", class: "axis-title",
      transform: "rotate(-90 16 " + (T + ph / 2) + ")" }, data.onCards ? "MiB on the cards" : "MiB in host memory"));

    // Labels at the right edge, laid out together at the end so that none covers another.
    const labels = [];

    // Free memory lines.
    for (const ln of lines) {
      if (!isNum(ln.mib)) continue;
      if (!inView.includes(ln)) {
        labels.push({ y: T + 4, text: "\u2191 " + ln.label + " (above)", cls: "free-label", parent: svgEl });
        continue;
      }
      svgEl.appendChild(sv("line", { x1: L, x2: L + pw, y1: Y(ln.mib), y2: Y(ln.mib), class: "free-line" }));
      labels.push({ y: Y(ln.mib) + 4, text: ln.label, cls: "free-label", parent: svgEl });
    }

    // One line per cache type, each with its own dash and marker shape; the chosen one thicker.
    const chosen = (plan.chosen || {}).cache_type;
    const largestBy = {};
    for (const c of largest.cache_types || []) largestBy[c.cache_type] = c;
    data.types.forEach((t, i) => {
      const ys = data.series[t];
      const pts = [];
      data.ns.forEach((n, j) => { if (isNum(ys[j])) pts.push([X(n), Y(ys[j])]); });
      if (!pts.length) return;
      const g = sv("g", { "data-cache-type": t });
      g.appendChild(sv("polyline", { points: pts.map((p) => p[0].toFixed(1) + "," + p[1].toFixed(1)).join(" "),
        class: "series s" + (i % 4), "stroke-width": t === chosen ? 4.5 : 2.5 }));
      for (const [px, py] of pts) g.appendChild(marker(i, px, py));
      // The largest context: where the line meets the free memory (or the trained context).
      const c = largestBy[t];
      if (c && isNum(c.n_ctx) && c.n_ctx > 0 && c.n_ctx <= nMax) {
        const v = valueAt(data.ns, ys, c.n_ctx);
        if (isNum(v)) {
          g.appendChild(sv("circle", { cx: X(c.n_ctx).toFixed(1), cy: Y(v).toFixed(1), r: 9, class: "cross" }));
        }
      }
      const last = pts[pts.length - 1];
      const lbl = t + (c && isNum(c.n_ctx) ? " (largest " + ctxLabel(c.n_ctx) + ")" : "") + (t === chosen ? " \u2190 chosen" : "");
      labels.push({ y: last[1] + 4, text: lbl, cls: "series-label m" + (i % 4), parent: g });
      svgEl.appendChild(g);
    });
    labels.sort((a, b) => a.y - b.y);
    let prevY = -Infinity;
    for (const lb of labels) {
      lb.y = Math.max(lb.y, prevY + 15);
      prevY = lb.y;
    }
    const overflow = prevY - (H - 4);
    for (const lb of labels) {
      if (overflow > 0) lb.y -= overflow;
      lb.parent.appendChild(sv("text", { x: L + pw + 14, y: lb.y.toFixed(1), class: lb.cls }, lb.text));
    }

    // The same numbers as a table.
    const hr = el("tr");
    hr.appendChild(el("th", { scope: "col" }, "n_ctx"));
    for (const t of data.types) hr.appendChild(el("th", { scope: "col" }, t + " MiB"));
    thead.appendChild(hr);
    data.ns.forEach((n, j) => {
      const tr = el("tr");
      tr.appendChild(el("th", { scope: "row" }, String(n)));
      for (const t of data.types) {
        const note = data.notes && data.notes[t] ? data.notes[t][j] : null;
        tr.appendChild(el("td", {}, note || fmtMiB(data.series[t][j])));
      }
      tbody.appendChild(tr);
    });
    bump("chartRenders");
  }

  function marker(i, x, y) {
    const cls = "m" + (i % 4);
    if (i % 3 === 1) return sv("rect", { x: (x - 4).toFixed(1), y: (y - 4).toFixed(1), width: 8, height: 8, class: cls });
    if (i % 3 === 2) {
      return sv("polygon", { points: [[x, y - 5.5], [x + 5, y + 4], [x - 5, y + 4]].map((p) => p[0].toFixed(1) + ","
        + p[1].toFixed(1)).join(" "), class: cls });
    }
    return sv("circle", { cx: x.toFixed(1), cy: y.toFixed(1), r: 4.5, class: cls });
  }

  // ---------- hypothetical cards ----------

  function renderCards() {
    const ul = $("cards");
    clear(ul);
    state.hypo.forEach((c, i) => {
      const li = el("li", { "data-card": c.name });
      li.appendChild(el("span", {}, c.name + ": " + fmtMiB(c.free_mib) + " of " + fmtMiB(c.total_mib) + " MiB free"));
      const b = el("button", { type: "button", "aria-label": "Remove " + c.name }, "Remove");
      b.addEventListener("click", () => {
        state.hypo.splice(i, 1);
        renderCards();
        $("card-add").focus();
        redraw();
      });
      li.appendChild(b);
      ul.appendChild(li);
    });
  }

  function addCard() {
    const name = $("card-name").value.trim() || "GPU";
    const free = Number($("card-free").value);
    const total = Number($("card-total").value);
    if (!isNum(free) || free < 0 || !isNum(total) || total <= 0) {
      showError("A card needs free and total memory in MiB, total above 0.");
      return;
    }
    if (free > total) {
      showError("Free memory cannot be more than the total.");
      return;
    }
    state.hypo.push({ name, free_mib: free, total_mib: total });
    renderCards();
    redraw();
  }

  // ---------- start ----------

  function wire() {
    $("controls").addEventListener("submit", (e) => { e.preventDefault(); redraw(); });
    $("model").addEventListener("change", () => { state.chartData = null; redraw(); });
    for (const id of ["cache-type", "flash-attn", "gpu", "keep-live"]) $(id).addEventListener("change", redraw);
    $("ctx-largest").addEventListener("change", () => {
      const fixed = !$("ctx-largest").checked;
      $("ctx-range").disabled = !fixed;
      $("ctx-number").disabled = !fixed;
      redraw();
    });
    $("ctx-range").addEventListener("input", () => { $("ctx-number").value = $("ctx-range").value; redrawSoon(); });
    $("ctx-number").addEventListener("change", () => { $("ctx-range").value = $("ctx-number").value; redraw(); });
    $("card-preset").addEventListener("change", () => {
      const v = $("card-preset").value;
      if (!v) return;
      const [name, total] = v.split("|");
      $("card-name").value = name;
      $("card-total").value = total;
      $("card-free").value = total;
    });
    $("card-add").addEventListener("click", addCard);
  }

  // The Models view loaded or unloaded a model (service/static/models.js): the model list says which are loaded.
  function relabelModels(models) {
    const loaded = new Set(models.filter((m) => m.state === "loaded").map((m) => m.name));
    for (const o of Array.from($("model").options)) o.textContent = o.value + (loaded.has(o.value) ? " (loaded)" : "");
  }

  async function start() {
    buildLegend();
    wire();
    document.addEventListener("gguf:models", (e) => relabelModels(e.detail || []));
    try {
      const models = await api("/v1/models");
      const sel = $("model");
      clear(sel);
      const data = models && Array.isArray(models.data) ? models.data : [];
      for (const m of data) sel.appendChild(el("option", { value: m.id }, m.id + (m.loaded ? " (loaded)" : "")));
      const loaded = data.find((m) => m.loaded);
      if (loaded) sel.value = loaded.id;
      if (!data.length) {
        setStatus("");
        showError("The service has no models to plan.");
        document.body.dataset.state = "error";
        return;
      }
    } catch (err) {
      showError("Could not list the models: " + err.message);
      document.body.dataset.state = "error";
      return;
    }
    await redraw();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
