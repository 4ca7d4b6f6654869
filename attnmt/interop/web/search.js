// Greedy and beam search over an attnmt ONNX export (interop/onnx.py), as attnmt's own
// (decoding/greedy.py, decoding/beam.py): the encoder graph once per batch, then one decoder
// step at a time, its state (caches, recurrent states) passed back in. Every memory and state
// tensor has its batch on axis 0, so keeping, repeating or reordering rows is one copy.
// In a page (after onnxruntime-web and tokenizer.js): AttnmtSearch.load("model/"). In Node,
// with onnxruntime-node installed: require("./search.js").load(FOLDER) (docs/exporting.md).
(function (root) {
  "use strict";
  const inNode = typeof module !== "undefined" && !!module.exports;
  const ort = inNode ? require("onnxruntime-node") : root.ort;
  const Tokenizer = inNode ? require("./tokenizer.js").Tokenizer : root.AttnmtTokenizer;
  const { Glossary, Constraints } = inNode ? require("./constraints.js") : root.AttnmtConstraints;

  // A file of the export: fetched in a page, read from disk in Node.
  async function readBytes(path) {
    if (inNode) return new Uint8Array(await require("node:fs/promises").readFile(path));
    const response = await fetch(path);
    if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
    return new Uint8Array(await response.arrayBuffer());
  }

  async function readJson(path) {
    return JSON.parse(new TextDecoder().decode(await readBytes(path)));
  }

  function size(dims) {
    return dims.reduce((a, b) => a * b, 1);
  }

  // The rows `index` of tensor t (batch on axis 0), in that order.
  function takeRows(t, index) {
    const width = size(t.dims.slice(1));
    const out = new t.data.constructor(index.length * width);
    index.forEach((r, i) => out.set(t.data.subarray(r * width, (r + 1) * width), i * width));
    return new ort.Tensor(t.type, out, [index.length, ...t.dims.slice(1)]);
  }

  function int64(values, dims) {
    return new ort.Tensor("int64", BigInt64Array.from(values, (v) => BigInt(v)), dims);
  }

  class Model {
    constructor(info, src, tgt, encoder, decoder, table) {
      Object.assign(this, { info, src, tgt, encoder, decoder, table });
      this.ids = info.ids;
      // Per target id: the piece continues the word before it (a letter or digit without
      // SentencePiece's word-start mark; Tokenizer.word_inner), where a glossary term may not end.
      this.inner = tgt.spec.pieces.map(
        ([piece, , kind]) => kind !== "control" && kind !== "unknown" && /^[\p{L}\p{N}]/u.test(piece),
      );
    }

    // The export in folder `base` (ending in "/").
    static async load(base) {
      const info = await readJson(base + "attnmt-onnx.json");
      const src = new Tokenizer(await readJson(base + info.tokenizer.source));
      const same = info.tokenizer.target === info.tokenizer.source;
      const tgt = same ? src : new Tokenizer(await readJson(base + info.tokenizer.target));
      const provider = inNode ? "cpu" : "wasm";
      const options = { executionProviders: [provider], graphOptimizationLevel: "all" };
      const encoder = await ort.InferenceSession.create(base + "encoder.onnx", options);
      const decoder = await ort.InferenceSession.create(base + "decoder.onnx", options);
      let table = null; // the lexical shortlist: each source id's k likeliest target ids
      if (info.shortlist) table = new Int32Array((await readBytes(base + info.shortlist.file)).buffer);
      return new Model(info, src, tgt, encoder, decoder, table);
    }

    // The sorted target ids a batch of sentences may output (decoding/shortlist.py; and the
    // ids of `phrases`, a glossary's), or null: the whole vocabulary.
    outputs(sources, phrases = []) {
      if (!this.table) return null;
      const { k, frequent, always } = this.info.shortlist;
      const found = new Set([...frequent, ...always, ...phrases.flat()]);
      for (const s of sources) {
        for (const id of s) {
          for (const t of this.table.subarray(id * k, (id + 1) * k)) if (t >= 0) found.add(t);
        }
      }
      return Int32Array.from(found).sort();
    }

    // attnmt's output limit: a × source subwords (EOS included) + b, rounded as configured.
    limit(srcLen) {
      const lim = this.info.output_limit;
      const scaled = Math.round(lim.a * srcLen * 1e6) / 1e6;
      const rounded = lim.round === "ceil" ? Math.ceil(scaled) : Math.floor(scaled);
      return Math.max(1, Math.min(rounded + lim.b, lim.max));
    }

    // A line's source ids: a multilingual model's tag of the target language first, EOS last.
    sourceIds(line, lang) {
      const tag = lang ? [this.info.target_tags[lang]] : [];
      const ids = this.src.encode(line).slice(0, this.info.max_src_len - 1 - tag.length);
      return [...tag, ...ids, this.ids.eos];
    }

    // The encoder over sentences (id lists): memory tensors and the state before BOS.
    async encode(sources) {
      const S = Math.max(...sources.map((s) => s.length));
      const flat = sources.flatMap((s) => [...s, ...Array(S - s.length).fill(this.ids.pad)]);
      const out = await this.encoder.run({ src: int64(flat, [sources.length, S]) });
      const memory = this.info.memory.map((name) => out[name]);
      const state = this.info.state.map((s) => {
        if (s.init === "encoder") return out[s.name];
        const dims = [sources.length, ...s.shape];
        return new ort.Tensor("float32", new Float32Array(size(dims)), dims);
      });
      return { memory, state };
    }

    // One decoder step: next-token log-probabilities (n × V, or n × V' over the shortlist's
    // ids `rows`; the never-output ids -inf).
    async step(prev, step, memory, state, rows = null) {
      const n = prev.length;
      const feed = { tokens: int64(prev, [n]) };
      if (this.info.max_positions) feed.position = int64(Array(n).fill(step), [n]);
      if (rows) feed.rows = int64(rows, [rows.length]);
      this.info.memory.forEach((name, i) => (feed[name] = memory[i]));
      this.info.state.forEach((s, i) => (feed[s.name] = state[i]));
      const out = await this.decoder.run(feed);
      const [logpName, ...stateNames] = this.info.decoder.outputs;
      const logp = out[logpName].data;
      const V = logp.length / n;
      const never = this.ids.never_output;
      const banned = rows ? never.map((id) => rows.indexOf(id)).filter((c) => c >= 0) : never;
      for (let r = 0; r < n; r++) for (const c of banned) logp[r * V + c] = -Infinity;
      return { logp, V, state: stateNames.map((name) => out[name]) };
    }

    // Greedy search of a batch of sentences: output ids, without EOS.
    async greedy(sources) {
      let { memory, state } = await this.encode(sources);
      const limits = sources.map((s) => this.limit(s.length));
      const out = sources.map(() => []);
      let active = sources.map((_, i) => i);
      let prev = sources.map(() => this.ids.bos);
      const rows = this.outputs(sources);
      for (let step = 0; active.length; step++) {
        const next = await this.step(prev, step, memory, state, rows);
        const keep = [];
        prev = [];
        active.forEach((sent, r) => {
          let best = 0;
          for (let v = 1; v < next.V; v++) if (next.logp[r * next.V + v] > next.logp[r * next.V + best]) best = v;
          if (rows) best = rows[best];
          if (best !== this.ids.eos) out[sent].push(best);
          if (best !== this.ids.eos && step + 1 < limits[sent]) keep.push(r), prev.push(best);
        });
        const all = keep.length === active.length; // no row left: nothing to copy
        active = keep.map((r) => active[r]);
        if (!all) memory = memory.map((t) => takeRows(t, keep));
        state = all ? next.state : next.state.map((t) => takeRows(t, keep));
      }
      return out;
    }

    // Beam search of one sentence (K beams; the length penalty and its form: `options`'
    // length_penalty and length_norm, else the model's, from the manifest): the best hypothesis.
    // As attnmt's BeamPool: with the GNMT form it stops once the best candidate is EOS; with
    // length^alpha ("length") once no live beam, normalised as if `lookahead` tokens longer,
    // can outscore the best finished hypothesis. `phrases` (target id lists, a glossary's):
    // the output must contain each (constraints.js), and the best hypothesis that does wins.
    async beam(source, K, options = {}, phrases = []) {
      const enc = await this.encode([source]);
      const zeros = Array(K).fill(0);
      let memory = enc.memory.map((t) => takeRows(t, zeros));
      let state = enc.state.map((t) => takeRows(t, zeros));
      const limit = this.limit(source.length);
      const alpha = options.length_penalty ?? this.info.length_penalty;
      const byLength = (options.length_norm ?? this.info.length_norm) === "length";
      const penalty = (length) => Math.pow(byLength ? length : (5 + length) / 6, alpha);
      let scores = [0, ...Array(K - 1).fill(-Infinity)];
      let tokens = zeros.map(() => []);
      let prev = zeros.map(() => this.ids.bos);
      const finished = [];
      const rows = this.outputs([source], phrases);
      const column = (id) => (rows ? rows.indexOf(id) : id);
      const chooser = phrases.length
        ? new Constraints(
            phrases.map((p) => p.map(column)), K,
            rows ? Array.from(rows, (id) => this.inner[id]) : this.inner, column(this.ids.eos),
          )
        : null;
      for (let step = 0; ; step++) {
        const next = await this.step(prev, step, memory, state, rows);
        const { finish, pick, bestIsEos } = chooser
          ? chooseConstrained(chooser, scores, next, K)
          : chooseByScore(scores, next, K, column(this.ids.eos));
        if (rows) for (const c of [...finish, ...pick]) c.token = rows[c.token];
        const length = step + 1;
        for (const c of finish) {
          finished.push({ tokens: tokens[c.beam], score: c.score / penalty(length), unmet: 0 });
        }
        tokens = pick.map((c) => [...tokens[c.beam], c.token]);
        scores = pick.map((c) => c.score);
        const atLimit = limit <= length;
        let stop = bestIsEos;
        if (byLength) {
          const top = Math.max(...finished.map((f) => f.score));
          stop = top >= Math.max(...scores) / penalty(length + this.info.lookahead);
        }
        if (atLimit) {
          tokens.forEach((t, j) => {
            const unmet = chooser ? chooser.unmet(chooser.rows[j]) : 0;
            finished.push({ tokens: t, score: scores[j] / penalty(length), unmet });
          });
        }
        if (atLimit || (stop && finished.length)) {
          // The best that met every phrase, if any did (attnmt's _Finished.done).
          const rank = (h) => [h.unmet === 0 ? 1 : 0, h.score];
          const better = (a, b) => rank(b)[0] > rank(a)[0] || (rank(b)[0] === rank(a)[0] && b.score > a.score);
          return finished.reduce((a, b) => (better(a, b) ? b : a)).tokens;
        }
        const beams = pick.map((c) => c.beam);
        state = next.state.map((t) => takeRows(t, beams));
        prev = pick.map((c) => c.token);
      }
    }

    // The target terms of the `glossary` terms (a constraints.js Glossary, or null) a line
    // holds, as target id lists, each target once.
    termPhrases(line, glossary) {
      const targets = new Set((glossary ? glossary.find(line) : []).map((t) => t.target));
      return [...targets].map((t) => this.tgt.encode(t));
    }

    // Each line's translation (empty lines stay empty): greedy in batches, or K beams
    // (`options`: the manifest's decoding options that beam search reads, by name, and
    // `glossary`: a Glossary, or its text, whose terms a line's translation must hold: those
    // lines by beam search, the model's beam size where K is 1).
    async translate(lines, K = 1, lang = null, options = {}) {
      const out = lines.map(() => "");
      let todo = lines.map((l, i) => i).filter((i) => lines[i].trim());
      let glossary = options.glossary ?? null;
      if (typeof glossary === "string") glossary = new Glossary(glossary);
      const phrases = new Map(todo.map((i) => [i, this.termPhrases(lines[i], glossary)]));
      const beamed = K > 1 ? todo : todo.filter((i) => phrases.get(i).length);
      for (const i of beamed) {
        const width = K > 1 ? K : Math.max(2, this.info.beam_size);
        const found = await this.beam(this.sourceIds(lines[i], lang), width, options, phrases.get(i));
        out[i] = this.tgt.decode(found);
      }
      todo = todo.filter((i) => !beamed.includes(i));
      const sources = todo.map((i) => this.sourceIds(lines[i], lang));
      const order = todo.map((_, j) => j).sort((a, b) => sources[a].length - sources[b].length);
      for (let at = 0; at < order.length; at += BATCH) {
        const part = order.slice(at, at + BATCH);
        const found = await this.greedy(part.map((j) => sources[j]));
        part.forEach((j, r) => (out[todo[j]] = this.tgt.decode(found[r])));
      }
      return out;
    }
  }

  const BATCH = 16; // sentences a greedy batch: similar lengths together

  // attnmt's choice without constraints: the 2K best extensions; those of the first K that
  // are EOS finish, the K best others go on; the search may stop if the best is EOS.
  function chooseByScore(scores, next, K, eos) {
    const cands = best(scores, next.logp, next.V, 2 * K);
    const finish = cands.slice(0, K).filter((c) => c.token === eos && c.score > -Infinity);
    const pick = cands
      .map((c) => ({ ...c, key: c.token === eos ? -Infinity : c.score }))
      .sort((a, b) => b.key - a.key)
      .slice(0, K)
      .map((c) => ({ ...c, score: c.key }));
    return { finish, pick, bestIsEos: cands[0].token === eos };
  }

  // The choice under a glossary's constraints (constraints.js), K beams kept: where fewer
  // candidates are left, dead ones (-inf) fill the places, as attnmt's do.
  function chooseConstrained(chooser, scores, next, K) {
    chooser.forbidEos(next.logp, next.V);
    const { finish, pick, bestIsEos } = chooser.choose(chooser.candidates(scores, next.logp, next.V), K);
    while (pick.length < K) {
      pick.push({ score: -Infinity, beam: 0, token: pick.length ? pick[0].token : chooser.eos });
      chooser.rows.push(chooser.rows[0] ?? { cur: -1, pos: 0, met: chooser.phrases.map(() => false) });
    }
    return { finish, pick, bestIsEos };
  }

  // The n best (beam, token) extensions of beam scores by next-token log-probs, best first.
  function best(scores, logp, V, n) {
    const top = [];
    scores.forEach((s, beam) => {
      if (s === -Infinity) return;
      for (let v = 0; v < V; v++) {
        const score = s + logp[beam * V + v];
        if (top.length === n && score <= top[n - 1].score) continue;
        let at = top.length;
        while (at > 0 && top[at - 1].score < score) at--;
        top.splice(at, 0, { score, beam, token: v });
        if (top.length > n) top.pop();
      }
    });
    return top;
  }

  if (inNode) {
    const load = (folder) => Model.load(folder.endsWith("/") ? folder : folder + "/");
    module.exports = { Model, load };
  } else root.AttnmtSearch = Model;
})(this);
