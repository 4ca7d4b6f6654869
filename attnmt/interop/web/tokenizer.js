// SentencePiece in the browser, from the JSON attnmt export writes (interop/tokenizer_json.py):
// unigram models segment by the Viterbi path of highest summed piece score (Kudo 2018), BPE
// models by merging the adjacent pair whose piece scores highest, leftmost first (Sennrich et
// al. 2016, as SentencePiece runs it). Text is normalized with NFKC (SentencePiece's nmt_nfkc
// rule besides a few control characters), its spaces escaped as "▁".
(function (root) {
  "use strict";
  const SPACE = "\u2581";
  const UNK_PENALTY = 10; // an unknown character scores the lowest piece score minus this
  const UNK_SURFACE = " \u2047 "; // how SentencePiece writes an unknown piece back

  class Tokenizer {
    constructor(spec) {
      this.spec = spec;
      this.ids = new Map(); // piece -> id, the pieces text may become
      this.reserved = new Map(); // language tags: SentencePiece matches them in text, attnmt
      this.anyPiece = new Map(); // then spells them in their characters' pieces
      this.maxLen = 1;
      let minScore = 0;
      spec.pieces.forEach(([piece, score, kind], id) => {
        if (!this.anyPiece.has(piece)) this.anyPiece.set(piece, id);
        if (kind === "reserved") this.reserved.set(piece, id);
        else if (kind === "normal" || kind === "user") {
          this.ids.set(piece, id);
          this.maxLen = Math.max(this.maxLen, Array.from(piece).length);
          minScore = Math.min(minScore, score);
        }
      });
      this.unkScore = minScore - UNK_PENALTY;
    }

    normalize(text) {
      let t = text.normalize("NFKC");
      if (this.spec.remove_extra_whitespaces) t = t.trim().replace(/\s+/g, " ");
      if (!t) return "";
      if (this.spec.escape_whitespaces !== false) t = t.replace(/ /g, SPACE);
      return this.spec.add_dummy_prefix ? SPACE + t : t;
    }

    encode(text) {
      const ids = [];
      for (const part of this.parts(Array.from(this.normalize(text)))) {
        if (typeof part === "string") ids.push(-1 - this.reserved.get(part));
        else if (part.length) ids.push(...(this.spec.model_type === "bpe" ? this.bpe(part) : this.viterbi(part)));
      }
      return mergeUnknown(ids, this.spec.unk_id).flatMap((id) => {
        if (id >= 0) return [id];
        const piece = this.spec.pieces[-1 - id][0];
        return Array.from(piece, (c) => this.anyPiece.get(c) ?? this.spec.unk_id);
      });
    }

    // The characters split around the reserved pieces they spell (strings), longest first.
    parts(chars) {
      if (!this.reserved.size) return [chars];
      const found = [];
      let start = 0;
      for (let i = 0; i < chars.length; i++) {
        for (let j = Math.min(chars.length, i + this.maxReserved()); j > i; j--) {
          const s = chars.slice(i, j).join("");
          if (!this.reserved.has(s)) continue;
          found.push(chars.slice(start, i), s);
          start = j;
          i = j - 1;
          break;
        }
      }
      found.push(chars.slice(start));
      return found;
    }

    maxReserved() {
      return Math.max(...Array.from(this.reserved.keys(), (p) => Array.from(p).length));
    }

    viterbi(chars) {
      const n = chars.length;
      const best = new Float64Array(n + 1).fill(-Infinity);
      const from = new Int32Array(n + 1);
      const piece = new Int32Array(n + 1);
      best[0] = 0;
      for (let i = 0; i < n; i++) {
        if (best[i] === -Infinity) continue;
        let single = false;
        let s = "";
        for (let j = i; j < Math.min(n, i + this.maxLen); j++) {
          s += chars[j];
          const id = this.ids.get(s);
          if (id === undefined) continue;
          if (j === i) single = true;
          const score = best[i] + this.spec.pieces[id][1];
          if (score > best[j + 1]) [best[j + 1], from[j + 1], piece[j + 1]] = [score, i, id];
        }
        const unk = best[i] + this.unkScore;
        if (!single && unk > best[i + 1]) {
          [best[i + 1], from[i + 1], piece[i + 1]] = [unk, i, this.spec.unk_id];
        }
      }
      const out = [];
      for (let j = n; j > 0; j = from[j]) out.push(piece[j]);
      return out.reverse();
    }

    bpe(chars) {
      const symbols = chars.slice();
      for (;;) {
        let at = -1;
        let top = -Infinity;
        for (let i = 0; i + 1 < symbols.length; i++) {
          const id = this.ids.get(symbols[i] + symbols[i + 1]);
          if (id !== undefined && this.spec.pieces[id][1] > top) [at, top] = [i, this.spec.pieces[id][1]];
        }
        if (at < 0) break;
        symbols.splice(at, 2, symbols[at] + symbols[at + 1]);
      }
      return symbols.map((s) => this.ids.get(s) ?? this.spec.unk_id);
    }

    decode(ids) {
      let text = "";
      let dummy = null; // whether the first piece starts with the space the encoder added
      for (const id of ids) {
        const [piece, , kind] = this.spec.pieces[id];
        if (kind === "control") continue;
        if (dummy === null) dummy = kind !== "unknown" && piece.startsWith(SPACE);
        text += kind === "unknown" ? UNK_SURFACE : piece;
      }
      text = text.split(SPACE).join(" ");
      return this.spec.add_dummy_prefix && dummy ? text.slice(1) : text;
    }
  }

  // SentencePiece writes a run of unknown characters as one unknown piece.
  function mergeUnknown(ids, unk) {
    return ids.filter((id, i) => !(id === unk && i > 0 && ids[i - 1] === unk));
  }

  if (typeof module !== "undefined" && module.exports) module.exports = { Tokenizer };
  else root.AttnmtTokenizer = Tokenizer;
})(this);
