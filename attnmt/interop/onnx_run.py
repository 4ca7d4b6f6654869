"""An ONNX export (attnmt.interop.onnx) run by onnxruntime: greedy and beam search as
attnmt's own, and the export's agreement with attnmt on both (what `attnmt export` prints)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from attnmt.data.tokenizer import EOS_ID, PAD_ID
from attnmt.decoding.search import SearchOptions, output_limit
from attnmt.decoding.translator import Translator
from attnmt.interop import agreement
from attnmt.interop.agreement import Agreement
from attnmt.interop.onnx import MANIFEST


class OnnxModel:
    """An exported folder run by onnxruntime: greedy and beam search as attnmt's (the
    export's check, the benchmark; the page's search.js is the same search in JavaScript)."""

    def __init__(self, folder: Path, threads: int = 1) -> None:
        import onnxruntime as ort

        self.info = json.loads((folder / MANIFEST).read_text())
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        cpu = ["CPUExecutionProvider"]
        self.encoder = ort.InferenceSession(str(folder / "encoder.onnx"), opts, providers=cpu)
        self.decoder = ort.InferenceSession(str(folder / "decoder.onnx"), opts, providers=cpu)
        self.inputs = self.info["decoder"]["inputs"]
        self.shortlist = self.info["shortlist"]
        if self.shortlist is not None:
            table = np.fromfile(folder / self.shortlist["file"], dtype="<i4")
            self.table = table.reshape(-1, self.shortlist["k"])  # (V_src, k)

    def rows(self, src: np.ndarray) -> np.ndarray:
        """The sorted target ids a batch (B, S) may output (decoding.shortlist.allowed)."""
        more = [*self.shortlist["frequent"], *self.shortlist["always"]]
        union = np.concatenate([self.table[src.reshape(-1)].reshape(-1), np.array(more)])
        return np.unique(union[union >= 0]).astype(np.int64)

    def limit(self, src_len: int) -> int:
        """attnmt's output limit (decoding.search.output_limit) from the manifest."""
        lim = self.info["output_limit"]
        options = SearchOptions(
            max_len_a=lim["a"], max_len_b=lim["b"], max_output_len=lim["max"],
            max_len_round=lim["round"],
        )  # fmt: skip
        return output_limit(src_len, options)

    def start(self, tokens: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Padded source ids (B, S) -> the memory tensors and the state before BOS."""
        names = self.info["encoder"]["outputs"]
        encoded = dict(zip(names, self.encoder.run(None, {"src": tokens}), strict=True))
        memory = [encoded[n] for n in self.info["memory"]]
        state = [
            encoded[s["name"]]
            if s["init"] == "encoder"
            else np.zeros((len(tokens), *s["shape"]), np.float32)
            for s in self.info["state"]
        ]
        return memory, state

    def greedy(self, src: list[list[int]]) -> list[list[int]]:
        """Source ids (EOS included) -> output ids (without EOS), as attnmt's greedy search."""
        ids = self.info["ids"]
        S = max(map(len, src))
        tokens = np.array([s + [PAD_ID] * (S - len(s)) for s in src], dtype=np.int64)
        memory, state = self.start(tokens)
        limits = np.array([self.limit(len(s)) for s in src])
        ids_of = self.rows(tokens) if self.shortlist is not None else None  # column -> id
        given, banned = ([ids_of] if ids_of is not None else []), self.banned_columns(ids_of)
        rows = np.arange(len(src))  # the sentence of each row still searched
        prev = np.full(len(src), ids["bos"], dtype=np.int64)
        out: list[list[int]] = [[] for _ in src]
        for step in range(int(limits.max())):
            logp, state = self.step(prev, step, given, memory, state)
            logp[:, banned] = -np.inf
            prev = logp.argmax(axis=1)
            prev = ids_of[prev] if ids_of is not None else prev
            for r, token in zip(rows, prev, strict=True):
                if token != ids["eos"]:
                    out[r].append(int(token))
            keep = (prev != ids["eos"]) & (step + 1 < limits[rows])
            if not keep.any():
                break
            rows, prev = rows[keep], prev[keep]
            memory = [m[keep] for m in memory]
            state = [s[keep] for s in state]
        return out

    def banned_columns(self, ids_of: np.ndarray | None) -> list[int]:
        """The decoder output's columns never output (among the shortlist's, with one)."""
        banned = list(self.info["ids"]["never_output"])
        if ids_of is None:
            return banned
        return [int(c) for c in np.nonzero(np.isin(ids_of, banned))[0]]

    def step(
        self, prev: np.ndarray, step: int, given: list[np.ndarray], memory: list, state: list
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """One decoder step: log-probabilities (rows, V) and the next state."""
        n = len(prev)
        position = [np.full(n, step, dtype=np.int64)] if self.info["max_positions"] else []
        values = [prev, *position, *given, *memory, *state]
        logp, *state = self.decoder.run(None, dict(zip(self.inputs, values, strict=True)))
        return logp, state

    def beam(self, src: list[int], K: int, alpha: float, norm: str) -> list[int]:
        """One sentence's source ids (EOS included) -> the best of K beams' output ids
        (without EOS), as attnmt's BeamPool and the page's search.js: a step extends the
        2K best (beam, token) pairs; EOS among the first K finishes a hypothesis (score /
        length penalty); GNMT stops once the best is EOS, `length` once no live beam can
        beat the best finished one `lookahead` tokens later."""
        ids = self.info["ids"]
        tokens = np.array([src], dtype=np.int64)
        memory, state = self.start(tokens)
        memory = [np.repeat(m, K, axis=0) for m in memory]
        state = [np.repeat(s, K, axis=0) for s in state]
        ids_of = self.rows(tokens) if self.shortlist is not None else None
        given, banned = ([ids_of] if ids_of is not None else []), self.banned_columns(ids_of)
        limit = self.limit(len(src))

        def penalty(length: int) -> float:
            return (length if norm == "length" else (5 + length) / 6) ** alpha

        scores = np.array([0.0] + [-np.inf] * (K - 1))
        hyps: list[list[int]] = [[] for _ in range(K)]
        prev = np.full(K, ids["bos"], dtype=np.int64)
        finished: list[tuple[float, list[int]]] = []
        for step in range(limit):
            logp, state = self.step(prev, step, given, memory, state)
            logp[:, banned] = -np.inf
            cands = _best(scores, logp.astype(np.float64), 2 * K)  # (score, beam, column)
            if ids_of is not None:
                cands = [(c, b, int(ids_of[t])) for c, b, t in cands]
            length = step + 1
            for score, b, token in cands[:K]:
                if token == ids["eos"] and score > -np.inf:
                    finished.append((score / penalty(length), hyps[b]))
            pick = sorted(
                ((-np.inf if t == ids["eos"] else c, b, t) for c, b, t in cands),
                key=lambda x: -x[0],
            )[:K]  # stable: equal keys keep the candidates' order
            hyps = [[*hyps[b], t] for _, b, t in pick]
            scores = np.array([c for c, _, _ in pick])
            stop = cands[0][2] == ids["eos"]
            if norm == "length":
                top = max((f for f, _ in finished), default=-np.inf)
                stop = top >= scores.max() / penalty(length + self.info["lookahead"])
            if length >= limit:
                finished += [(c / penalty(length), h) for c, h in zip(scores, hyps, strict=True)]
            if length >= limit or (stop and finished):
                return max(finished, key=lambda f: f[0])[1]
            state = [s[[b for _, b, _ in pick]] for s in state]
            prev = np.array([t for _, _, t in pick], dtype=np.int64)
        return max(finished, key=lambda f: f[0])[1] if finished else hyps[0]


def check_agreement(
    out: Path, model_dir: Path, weights: str, lines: list[str], source: str
) -> list[Agreement]:
    """The export's output (onnxruntime) against attnmt's, sentence by sentence: greedy, and
    beam search with the model's beam, length penalty and its form (a multilingual model
    into each of its target languages; with its shortlist if it has one)."""
    theirs = OnnxModel(out)
    short = theirs.shortlist is not None
    ours = Translator.load(
        model_dir, "cpu", weights, "fp32", workers=1, shortlist=short, compile=False
    )
    langs: list[str | None] = list(ours.target_langs) if ours.cfg.data.multilingual else [None]
    info = theirs.info
    K = info["beam_size"]
    found = []
    for lang in langs:
        prefix = ours.source_prefix(lang)
        src = [[*prefix, *ids, EOS_ID] for ids in ours.tokenizer.src.encode(lines)]
        for beam in [1, K] if K > 1 else [1]:
            if short:  # a shortlist is a batch's: each sentence alone on both sides
                want = [ours.translate([line], beam=beam, target_lang=lang)[0] for line in lines]
            else:
                want = ours.translate(lines, beam=beam, target_lang=lang)
            if beam == 1:
                got = [theirs.greedy([s])[0] for s in src]
            else:
                alpha, norm = info["length_penalty"], info["length_norm"]
                got = [theirs.beam(s, beam, alpha, norm) for s in src]
            texts = [ours.tokenizer.tgt.decode(g) for g in got]
            same = sum(t == w for t, w in zip(texts, want, strict=True))
            how = "greedy" if beam == 1 else f"beam {beam}"
            into = f"into {lang}" if lang else ""
            found.append(Agreement(same, len(lines), source, into, how, want, texts))
    return found


def report_agreement(out: Path, model_dir: Path, weights: str, given: Path | None) -> None:
    """Print the export's agreement with attnmt (check_agreement on check_lines)."""
    quantization = json.loads((out / MANIFEST).read_text())["quantization"]

    def check(lines: list[str], source: str) -> list[Agreement]:
        return check_agreement(out, model_dir, weights, lines, source)

    quantized = None if quantization == "float32" else quantization
    agreement.report_agreement(check, model_dir, given, quantized)


def _best(scores: np.ndarray, logp: np.ndarray, n: int) -> list[tuple[float, int, int]]:
    """The n best (score, beam, column) extensions of the live beams' scores (K,) by the
    next token's log-probabilities (K, V), best first; equal scores in (beam, column) order
    (as search.js's `best`)."""
    live = np.flatnonzero(np.isfinite(scores))
    flat = (scores[live, None] + logp[live]).reshape(-1)  # (L * V,)
    V = logp.shape[1]
    order = np.argsort(-flat, kind="stable")[:n]
    return [(float(flat[i]), int(live[i // V]), int(i % V)) for i in order]
