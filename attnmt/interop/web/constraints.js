// A glossary in the browser (and in Node), as attnmt applies a terminology file: the terms a
// line contains, found as decoding/terminology.py finds them (the longest form at each place,
// on word boundaries, with the case the glossary gives), and their target terms made
// constraints of that line's beam search by dynamic beam allocation (Post & Vilar 2018), as
// decoding/constraints.py does it for one sentence's K beams: every beam tracks which phrases
// it has met and how far it is into the one it is in the middle of; its bank is the number
// of constraint tokens met (in half tokens: a phrase whose last piece waits for the end of its
// word ranks below a met one); the K places go round-robin over the banks, the bank with most
// met first, each bank's candidates best first; a beam may end only once it met every phrase.
(function (root) {
  "use strict";
  const WORD = "[\\p{L}\\p{N}_]"; // Python's \w, which the terminology's pattern uses

  // "source<TAB>target" lines (a terminology file's, as `attnmt translate --terminology`
  // reads them) or "source = target" lines; a source may list forms separated by "|";
  // blank lines and lines starting with # are skipped. A line that is neither throws an
  // Error naming its number.
  class Glossary {
    constructor(text, ignoreCase = false) {
      this.ignoreCase = ignoreCase;
      this.terms = new Map(); // form (lower-cased with ignoreCase) -> { source, target }
      text.split("\n").forEach((raw, n) => {
        const line = raw.replace(/\r$/, "");
        if (!line.trim() || line.startsWith("#")) return;
        const tab = line.indexOf("\t");
        const at = tab >= 0 ? tab : line.indexOf("=");
        const forms = line.slice(0, Math.max(at, 0)).split("|").map((f) => f.trim());
        const target = line.slice(at + 1).trim();
        if (at < 1 || !target || !forms.every(Boolean)) {
          throw new Error(`glossary line ${n + 1}: expected source TAB target, or source = target`);
        }
        const term = { source: forms.join("|"), target };
        for (const form of forms) this.terms.set(this.key(form), term);
      });
      const forms = [...this.terms.keys()].sort((a, b) => Array.from(b).length - Array.from(a).length);
      const escaped = forms.map((f) => f.replace(/[.*+?^${}()|[\]\\/-]/g, "\\$&"));
      this.pattern = forms.length
        ? new RegExp(`(?<!${WORD})(?:${escaped.join("|")})(?!${WORD})`, ignoreCase ? "giu" : "gu")
        : null;
    }

    key(form) {
      return this.ignoreCase ? form.toLowerCase() : form;
    }

    get size() {
      return new Set(this.terms.values()).size;
    }

    // The terms `line` contains, in their order there, each once.
    find(line) {
      if (!this.pattern) return [];
      const found = [];
      for (const m of line.matchAll(this.pattern)) {
        const term = this.terms.get(this.key(m[0]));
        if (term && !found.includes(term)) found.push(term);
      }
      return found;
    }
  }

  // One sentence's K beams under its phrases (lists of token columns); `inner` (per column:
  // the piece continues the word before it) and `eos` (EOS's column).
  class Constraints {
    constructor(phrases, K, inner, eos) {
      Object.assign(this, { phrases, inner, eos });
      this.lens = phrases.map((p) => p.length);
      this.banks = 2 * this.lens.reduce((a, b) => a + b, 0) + 1;
      this.rows = Array.from({ length: K }, () => ({ cur: -1, pos: 0, met: phrases.map(() => false) }));
    }

    waiting(row) {
      return row.cur >= 0 && row.pos === this.lens[row.cur];
    }

    unmet(row) {
      return row.met.filter((m) => !m).length;
    }

    // In place on the K beams' log-probs (K × V): EOS only where every phrase is met (or
    // waits for its boundary, which EOS is).
    forbidEos(logp, V) {
      this.rows.forEach((row, r) => {
        if (this.unmet(row) - (this.waiting(row) ? 1 : 0) > 0) logp[r * V + this.eos] = -Infinity;
      });
    }

    // Per beam, the tokens that advance a constraint: the next of the phrase it is in, else
    // the first of each unmet one; a beam waiting for a boundary: the best one.
    nextTokens(row, logp, r, V) {
      const next = this.phrases.map(() => -1);
      if (this.waiting(row)) {
        let best = -1;
        for (let v = 0; v < V; v++) {
          if (!this.inner[v] && (best < 0 || logp[r * V + v] > logp[r * V + best])) best = v;
        }
        next[0] = best;
      } else if (row.cur >= 0) next[row.cur] = this.phrases[row.cur][row.pos];
      else this.phrases.forEach((p, c) => (next[c] = row.met[c] ? -1 : p[0]));
      return next;
    }

    // A beam's state after token t (constraints.py's advance).
    advance(row, t) {
      const met = [...row.met];
      const full = this.waiting(row);
      if (full && (!this.inner[t] || t === this.eos)) met[row.cur] = true;
      const goesOn = row.cur >= 0 && !full && t === this.phrases[row.cur][row.pos];
      const first = this.phrases.findIndex((p, c) => !met[c] && p[0] === t);
      const starting = first >= 0 && !goesOn;
      const cur = goesOn ? row.cur : starting ? first : -1;
      const pos = goesOn ? row.pos + 1 : starting ? 1 : 0;
      return { cur, pos, met };
    }

    // The step's candidates from the beams' scores (K) and log-probs (K × V): each beam's 2K
    // best tokens and its constraint tokens, each (beam, token) once, best first, with their
    // place in the allocation order (key) and state.
    candidates(scores, logp, V) {
      const K = scores.length;
      const found = [];
      const seen = new Set();
      const add = (beam, token) => {
        if (token < 0 || seen.has(beam * V + token)) return;
        seen.add(beam * V + token);
        const score = scores[beam] + logp[beam * V + token];
        if (score > -Infinity) found.push({ score, beam, token, order: found.length });
      };
      this.rows.forEach((row, b) => topTokens(logp, b, V, Math.min(2 * K, V)).forEach((t) => add(b, t)));
      this.rows.forEach((row, b) => this.nextTokens(row, logp, b, V).forEach((t) => add(b, t)));
      found.sort((x, y) => y.score - x.score || x.order - y.order);
      const counts = new Map();
      for (const c of found) {
        c.state = this.advance(this.rows[c.beam], c.token);
        const { cur, pos, met } = c.state;
        const waits = cur >= 0 && pos === this.lens[cur] ? 1 : 0;
        const metTokens = met.reduce((n, m, i) => n + (m ? this.lens[i] : 0), 0);
        const bank = 2 * (metTokens + pos) - waits;
        const rank = counts.get(bank) ?? 0;
        counts.set(bank, rank + 1);
        c.key = rank * this.banks + (this.banks - 1 - bank);
        c.full = met.every(Boolean);
      }
      return found;
    }

    // constraints.py's choose: which candidates finish (EOS among the K first by key), the K
    // that go on (the first by key that are not EOS; the beams take their states), and
    // whether the best candidate that met every phrase is EOS.
    choose(cands, K) {
      const byKey = [...cands].sort((x, y) => x.key - y.key);
      const finish = byKey.slice(0, K).filter((c) => c.token === this.eos);
      const pick = byKey.filter((c) => c.token !== this.eos).slice(0, K);
      const firstFull = cands.find((c) => c.full);
      this.rows = pick.map((c) => c.state);
      return { finish, pick, bestIsEos: firstFull !== undefined && firstFull.token === this.eos };
    }
  }

  // The n best token ids of row r of logp (best first).
  function topTokens(logp, r, V, n) {
    const top = [];
    for (let v = 0; v < V; v++) {
      const x = logp[r * V + v];
      if (top.length === n && x <= logp[r * V + top[n - 1]]) continue;
      let at = top.length;
      while (at > 0 && logp[r * V + top[at - 1]] < x) at--;
      top.splice(at, 0, v);
      if (top.length > n) top.pop();
    }
    return top;
  }

  const api = { Glossary, Constraints };
  if (typeof module !== "undefined" && module.exports) module.exports = api;
  else root.AttnmtConstraints = api;
})(this);
