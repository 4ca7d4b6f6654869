// The page: loads the model from model/, translates the text area's lines (or ?q=TEXT on
// load) and shows them in #output, a line per line. It names the model's direction ("German →
// English", from the manifest's languages); a glossary (#glossary, ?glossary=LINES) makes its
// terms constraints of the lines that hold them (constraints.js). ?beam=K sets the beam size
// (under "More options", with what the model is); a multilingual model's target language is
// chosen in #lang (?lang=L); the manifest's other decoding options (its "options":
// length_penalty, length_norm) are taken from the URL by name, within their bounds, and the
// options it cannot do ("not_supported") are listed in #limits.
(async function () {
  "use strict";
  const $ = (id) => document.getElementById(id);
  // ?q=TEXT, or #q=TEXT for a text longer than a server takes in a URL (the fragment stays
  // in the browser).
  const params = new URLSearchParams(location.search);
  for (const [key, value] of new URLSearchParams(location.hash.slice(1))) params.set(key, value);
  ort.env.wasm.wasmPaths = new URL("runtime/", location.href).href;
  // ?threads=N: onnxruntime-web's threads (used where the page is cross-origin isolated).
  if (params.has("threads")) ort.env.wasm.numThreads = parseInt(params.get("threads"), 10) || 1;
  let model;
  try {
    ort.env.wasm.wasmBinary = await runtimeModule("runtime/ort-wasm-simd-threaded.wasm.gz");
    model = await AttnmtSearch.load("model/");
  } catch (e) {
    $("status").textContent = "";
    $("error").textContent = location.protocol === "file:"
      ? "This page was opened as a file, and a browser does not let such a page read its " +
        "model. Serve its folder instead: in a terminal, python -m http.server -d FOLDER " +
        "8000 (FOLDER: the one holding index.html), then open http://localhost:8000/"
      : `the model could not be loaded: ${e.message || e}`;
    document.body.dataset.ready = "1";  // what a waiting script reads: loading is over
    return;
  }
  const threads = ort.env.wasm.numThreads;
  $("status").textContent = "Ready. The translation runs in this browser: nothing you type " +
    "leaves this page.";
  $("about").textContent =
    `The model: ${model.info.arch}, ${model.info.quantization}, run by onnxruntime-web ` +
    `(WebAssembly${threads > 1 ? `, ${threads} threads` : ", 1 thread"}).`;
  const named = model.info.languages || { source: [], target: [] };
  if (named.source.length && named.target.length) {
    const direction = `${named.source.map(language).join(", ")} → ${named.target.map(language).join(", ")}`;
    $("direction").textContent = direction;
    $("direction").hidden = false;
    document.title = `Translate ${direction}`;
  }
  const langs = Object.keys(model.info.target_tags);
  for (const lang of langs) $("lang").add(new Option(language(lang), lang));
  $("lang-label").hidden = !langs.length;
  if (langs.includes(params.get("lang"))) $("lang").value = params.get("lang");
  const declared = model.info.options;
  $("beam").max = declared.beam.max;
  const asked = urlOptions(declared, params);
  const limits = Object.entries(model.info.not_supported);
  $("limits").textContent = limits.length
    ? `Not in this page: ${limits.map(([name, why]) => `${name} (${why})`).join("; ")}.`
    : "";
  $("go").disabled = false;

  async function translate() {
    const lines = $("source").value.split("\n");
    const { min, max } = declared.beam;
    const beam = Math.max(min, Math.min(max, parseInt($("beam").value, 10) || 1));
    $("error").textContent = "";
    let glossary;
    try {
      glossary = new AttnmtConstraints.Glossary($("glossary").value);
    } catch (e) {
      $("error").textContent = `${e.message}`;
      return;
    }
    $("go").disabled = true;
    const start = performance.now();
    try {
      const lang = langs.length ? $("lang").value : null;
      const out = await model.translate(lines, beam, lang, { ...asked, glossary });
      const seconds = (performance.now() - start) / 1000;
      $("output").textContent = out.join("\n");
      const used = [...new Set(lines.flatMap((l) => glossary.find(l)))];
      $("terms").hidden = !used.length;
      $("terms").textContent = "Glossary terms used: " + used.map((t) => `${t.source} → ${t.target}`).join("; ");
      const words = out.reduce((n, s) => n + (s.trim() ? s.trim().split(/\s+/).length : 0), 0);
      window.attnmtTiming = { sentences: lines.length, words, seconds };
      $("status").textContent = `Translated ${lines.length} line(s), ${words} words, in ${seconds.toFixed(1)} s.`;
    } catch (e) {
      $("error").textContent = `translation failed: ${e.message || e}`;
    } finally {
      $("go").disabled = false;
    }
  }

  // A language's name in English ("de": German), else its code.
  function language(code) {
    try {
      return new Intl.DisplayNames(["en"], { type: "language" }).of(code) || code;
    } catch (e) {
      return code;
    }
  }

  // The manifest's options given in the URL (?length_norm=length&length_penalty=0.6), each
  // within its bounds or among its choices; the beam is the form's.
  function urlOptions(options, params) {
    const asked = {};
    for (const [name, o] of Object.entries(options)) {
      if (name === "beam" || !params.has(name)) continue;
      const value = params.get(name);
      if (o.choices) {
        if (o.choices.includes(value)) asked[name] = value;
      } else {
        const number = Number(value);
        if (Number.isFinite(number)) asked[name] = Math.max(o.min, Math.min(o.max, number));
      }
    }
    return asked;
  }

  // The WebAssembly module, shipped gzipped: inflated here unless the server already did
  // (a server that sends it with Content-Encoding: gzip hands fetch the module itself).
  async function runtimeModule(url) {
    const response = await fetch(url);
    if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
    const bytes = new Uint8Array(await response.arrayBuffer());
    if (bytes[0] !== 0x1f || bytes[1] !== 0x8b) return bytes;
    const inflated = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
    return new Uint8Array(await new Response(inflated).arrayBuffer());
  }

  $("form").addEventListener("submit", (e) => { e.preventDefault(); translate(); });
  $("source").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); translate(); }
  });
  if (params.has("beam")) $("beam").value = params.get("beam");
  if (params.has("glossary")) $("glossary").value = params.get("glossary");
  if (params.has("q")) {
    $("source").value = params.get("q");
    await translate();
  }
  document.body.dataset.ready = "1";
})();
