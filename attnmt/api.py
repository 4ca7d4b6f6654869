"""The Python API: a trained model directory loaded once, translating lists of sentences.

    from attnmt import Translator
    translator = Translator.load("runs/m30k_transformer")
    translator.translate(["Ein Mann fährt Fahrrad."], beam=5)   # -> ["A man rides a bike."]

It is what `attnmt translate` and `attnmt eval` run: the same loading checks (safetensors with
checksums, no unpickling) and the same search, so it gives exactly the CLI's lines.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from attnmt.checkpoint import BEST_FILE, LAST_FILE, load_model_dir
from attnmt.config import Config
from attnmt.errors import AttnmtError
from attnmt.evaluate import (
    Scores,
    Translation,
    for_decoding,
    score,
    search_options,
)
from attnmt.evaluate import translate as run_search
from attnmt.kernels import (
    BACKENDS,
    CPU_MATMUL_INSTRUCTIONS,
    PRECISION_DTYPES,
    cpu_matmul_hardware,
    limit_onednn_kernel_cache,
    matmul_backend,
)
from attnmt.kernels.matmul import resolve
from attnmt.search import SearchOptions
from attnmt.seq2seq import AttentionSpec, Seq2Seq
from attnmt.tokenizer import Tokenizer
from attnmt.train import resolve_device


@dataclass
class Translator:
    """A model ready to translate with, and the CPU matmul backend it runs under."""

    cfg: Config
    tokenizer: Tokenizer
    model: Seq2Seq
    device: torch.device
    matmul: str  # blas or onednn

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        device: str = "auto",
        weights: str = "best",
        precision: str | None = None,
        matmul: str | None = None,
    ) -> Translator:
        """Load a model directory: `weights` best, last, averaged, step-N or a path; device
        auto, cpu or cuda; precision fp32, bf16 or fp16 (default decode.precision); matmul
        auto, blas or onednn (default decode.matmul). Notes go to stderr."""
        model_dir = Path(model_dir)
        if device not in ("auto", "cpu", "cuda"):
            raise AttnmtError(f"--device {device!r}: expected auto, cpu or cuda")
        if precision is not None and precision not in PRECISION_DTYPES:
            raise AttnmtError(f"--precision {precision!r}: expected fp32, bf16 or fp16")
        if matmul is not None and matmul not in BACKENDS:
            raise AttnmtError(f"--matmul {matmul!r}: expected {', '.join(BACKENDS)}")
        dev = resolve_device(device)
        cfg, tokenizer, net = load_model_dir(model_dir, weights, dev)
        if weights == "best" and not (model_dir / BEST_FILE).is_file():
            _note(f"{model_dir} has no {BEST_FILE} yet; using {LAST_FILE}")
        precision = precision or cfg.decode.precision
        backend = resolve(matmul or cfg.decode.matmul)
        if dev.type == "cpu" and (precision != "fp32" or backend == "onednn"):
            limit_onednn_kernel_cache()  # oneDNN runs these matmuls; as training does
        if dev.type == "cpu" and not cpu_matmul_hardware(precision):
            _note(
                f"this CPU has no {precision} matmul instructions "
                f"({CPU_MATMUL_INSTRUCTIONS[precision]}); "
                f"{precision} decoding is emulated and may be slower than fp32"
            )
        return cls(cfg, tokenizer, for_decoding(net, precision), dev, backend)

    def translate(
        self,
        lines: Sequence[str],
        beam: int | None = None,
        length_penalty: float | None = None,
        batch_tokens: int | None = None,
        workers: int = 1,
    ) -> list[str]:
        """The best translation of each line, in order (beam: default decode.beam; 1 is
        greedy). An empty line gives an empty translation."""
        found = self.hypotheses(lines, beam, 1, length_penalty, batch_tokens, workers)
        return [h[0].text for h in found]

    def hypotheses(
        self,
        lines: Sequence[str],
        beam: int | None = None,
        n_best: int = 1,
        length_penalty: float | None = None,
        batch_tokens: int | None = None,
        workers: int = 1,
        sampling: tuple[float, int, int] | None = None,
    ) -> list[list[Translation]]:
        """The n_best translations of each line with their scores (Translation.text, .score);
        `sampling` = (temperature, top_k, seed) draws n_best instead of searching."""
        options = self.options(beam, n_best, length_penalty, sampling=sampling)
        return self.search(lines, options, batch_tokens, workers)

    def options(
        self,
        beam: int | None = None,
        n_best: int = 1,
        length_penalty: float | None = None,
        attention: AttentionSpec | None = None,
        sampling: tuple[float, int, int] | None = None,
    ) -> SearchOptions:
        """SearchOptions from the model's decode section and these overrides; n_best above
        the beam is refused (sampling draws any number)."""
        beam = self.cfg.decode.beam if beam is None else beam
        if n_best > beam and sampling is None:
            raise AttnmtError(f"--n-best {n_best} exceeds the beam size {beam}; raise --beam")
        return search_options(
            self.cfg.decode, beam=beam, length_penalty=length_penalty, n_best=n_best,
            attention=attention, sampling=sampling,
        )  # fmt: skip

    def search(
        self,
        lines: Sequence[str],
        options: SearchOptions,
        batch_tokens: int | None = None,
        workers: int = 1,
        first_line: int = 0,
    ) -> list[list[Translation]]:
        """Search (or sample) with `options` over lines: what the other methods call.
        `first_line`: the number of lines before these in a longer input (sampling seeds)."""
        with matmul_backend(self.matmul):
            return run_search(
                self.model, self.tokenizer, list(lines), options,
                batch_tokens=batch_tokens or self.cfg.decode.batch_tokens, device=self.device,
                workers=workers, first_line=first_line,
            )  # fmt: skip

    @staticmethod
    def score(hypotheses: Sequence[str], references: Sequence[str]) -> Scores:
        """Corpus BLEU and chrF with sacreBLEU (.bleu, .chrf, .bleu_signature, .as_dict())."""
        if len(hypotheses) != len(references):
            raise AttnmtError(f"{len(hypotheses)} hypotheses but {len(references)} references")
        return score(hypotheses, references)


def _note(text: str) -> None:
    print(f"attnmt: note: {text}", file=sys.stderr)
