"""The Transformer's decoder layers at a decoding step, compiled ahead of time (AOTInductor) into
a package of generated C++ and loaded back: the lean step's maths (attnmt.models.lean_step) run
as one call, without Python between the operations. fp32 or int8 on the CPU, one cohort of
rows (greedy's, beam search's, a pool's), self-attention or SSRU layers.

Why: a step of a few rows costs its ~200 dispatched torch operations and fbgemm's per-call
costs more than its arithmetic (issue 79). `torch.export` traces this module with the rows,
the source length and the cache's length as dynamic dimensions; Inductor freezes the weights
(packed once for oneDNN) and generates the element-wise parts (layer norms, attention's small
products, residuals) as fused loops. The 8-minute T, 1 thread, AMD Zen 4, ms a step at 1 / 8
/ 64 rows: 1.10 / 2.02 / 9.57 against the lean step's 2.24 / 4.19 / 13.77
(docs/log/2026-12-compiled-step.md).

A package is made once per model, machine and threading (one thread, or several) and kept in
a cache folder (ATTNMT_CACHE, else ~/.cache/attnmt): compiling takes 15-30 s on 2 cores,
loading one under a second. Compiled for one thread its loops are serial; for several they
are OpenMP loops without a fixed count, which run on the threads torch has when they run (the
products too), so a machine whose load changes the thread count compiles at most twice.
Where no C++ compiler is present or the compile fails, decoding keeps the lean step and one
line says why.

The step writes the rows' keys and values into their cache buffers (decoding_state.Room) in
place, at position `at`, and attends over the last L positions up to it (L: the length of
`self_mask` (N, 1, 1, L), -inf where a row that joined a running pool has no position; the
positions before them are no row's, decoding_state.Room.start); the embedding, the last
layer norm and the output layer (which a shortlist may replace) stay outside, as does search.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.fx.experimental._config as fx_config
import torch.nn.functional as F
from torch import nn

from attnmt.kernels.int8 import Int8Linear
from attnmt.models.lean_step import LeanLayer, LeanStep, Product
from attnmt.models.transformer import TransformerSeq2Seq

Tensor = torch.Tensor


def cache_folder() -> Path:
    """Where compiled steps are kept: $ATTNMT_CACHE/steps, else ~/.cache/attnmt/steps."""
    root = os.environ.get("ATTNMT_CACHE") or Path.home() / ".cache" / "attnmt"
    return Path(root) / "steps"


class _Linear(nn.Module):
    """x Wᵀ + b from a lean step's fp32 Product (Wᵀ stored (K, N))."""

    def __init__(self, product: Product) -> None:
        super().__init__()
        assert product.weight_t is not None and product.bias is not None
        self.weight_t = nn.Parameter(product.weight_t.detach().clone(), requires_grad=False)
        self.bias = nn.Parameter(product.bias.detach().clone(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return torch.addmm(self.bias, x, self.weight_t)  # (N, K) -> (N, N_out)


class _Int8Linear(nn.Module):
    """x Wᵀ + b in 8-bit integers from an Int8Linear's weight (int8, a symmetric scale per
    output row s_W): each input row quantized symmetrically, s_x = max|x_row| / 127,

        y = s_x s_W (q_x q_Wᵀ) + b        q_x = round(x / s_x)

    (Int8Linear's fbgemm call quantizes x asymmetrically to uint8, one scale per call: the
    outputs differ by rounding.)"""

    def __init__(self, layer: Int8Linear) -> None:
        super().__init__()
        q = layer.q_weight
        bias = layer.bias if layer.bias is not None else torch.zeros(layer.out_features)
        self.q_weight_t = nn.Parameter(q.int_repr().t().contiguous(), requires_grad=False)
        scales = q.q_per_channel_scales().float()
        self.scales = nn.Parameter(scales, requires_grad=False)  # (N_out,)
        self.bias = nn.Parameter(bias.detach().float().clone(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        s_x = x.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127  # (N, 1)
        q_x = (x / s_x).round().to(torch.int8)  # (N, K)
        return torch._int_mm(q_x, self.q_weight_t).float() * (s_x * self.scales) + self.bias


def _product(product: Product) -> nn.Module:
    """A lean step's product as the compiled step computes it: fp32 or int8."""
    if isinstance(product.module, Int8Linear) and product.weight_t is None:
        return _Int8Linear(product.module)
    return _Linear(product)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """softmax(q kᵀ / √d_h + mask) v: q (B, h, G, d_h) (G queries a row: a sentence's beams
    over its memory), k, v (B, h, T, d_h), mask additive (B|1, 1, 1, T) -> (B, h, G, d_h).
    As element-wise products and sums, which Inductor fuses into loops: a matrix product here
    would make export guard on the keys' layout (T below the cache's capacity, or at it) and
    on G (1 or not)."""
    scores = (q.unsqueeze(3) * k.unsqueeze(2)).sum(-1) * q.size(-1) ** -0.5 + mask  # (B, h, G, T)
    return (scores.softmax(-1).unsqueeze(-1) * v.unsqueeze(2)).sum(-2)


class _Layer(nn.Module):
    """One decoder layer (DecoderLayer.step), pre- or post-norm:
    x += SelfAttn(LN(x)) (or an SSRU: _SsruLayer); x += CrossAttn(LN(x), memory);
    x += FFN(LN(x))."""

    def __init__(self, lean: LeanLayer, pre_norm: bool, activation: str) -> None:
        super().__init__()
        self.norms = nn.ModuleList(lean.norms)
        if lean.ssru is None:
            assert lean.qkv is not None and lean.out is not None
            self.qkv, self.out = _product(lean.qkv), _product(lean.out)
        self.cross_q, self.cross_out = _product(lean.cross_q), _product(lean.cross_out)
        self.ff_in, self.ff_out = _product(lean.ff_in), _product(lean.ff_out)
        self.heads, self.pre_norm, self.activation = lean.heads, pre_norm, activation

    def _in(self, i: int, x: Tensor) -> Tensor:
        return self.norms[i](x) if self.pre_norm else x

    def _out(self, i: int, y: Tensor) -> Tensor:
        return y if self.pre_norm else self.norms[i](y)

    def _act(self, f: Tensor) -> Tensor:
        if self.activation == "gelu":
            return F.gelu(f)
        return F.silu(f) if self.activation == "swish" else torch.relu(f)

    def forward(
        self,
        x: Tensor,
        at: Tensor,
        upto: int,
        self_mask: Tensor,
        keys: Tensor,
        values: Tensor,
        memory: tuple[Tensor, Tensor, Tensor],
    ) -> Tensor:
        """x (N, d) -> (N, d); keys, values (N, h, capacity, d_h) take this step's k and v at
        position `at` (1,) (= upto - 1), and positions upto - L .. upto - 1 are attended to
        (L: self_mask's length); memory: cross-attention's keys, values (B, h, S, d_h) and the
        source mask (B, 1, 1, S), each of B sentences read by N // B rows (its beams)."""
        N, d = x.shape
        h_ = self.heads
        d_h = d // h_
        first = upto - self_mask.size(-1)
        q, k, v = self.qkv(self._in(0, x)).view(N, 3, h_, 1, d_h).unbind(1)  # (N, h, 1, d_h)
        keys.index_copy_(2, at, k)
        values.index_copy_(2, at, v)
        a = attend(q, keys[:, :, first:upto], values[:, :, first:upto], self_mask)  # (N, h, 1, d_h)
        x = self._out(0, self.out(a.reshape(N, d)) + x)
        return self._cross_and_ff(x, memory)

    def _cross_and_ff(self, x: Tensor, memory: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        N, d = x.shape
        h_ = self.heads
        cross_k, cross_v, src_mask = memory
        B = cross_k.size(0)
        q = self.cross_q(self._in(1, x)).view(B, -1, h_, d // h_).transpose(1, 2)  # (B, h, G, d_h)
        a = attend(q, cross_k, cross_v, src_mask).transpose(1, 2).reshape(N, d)
        x = self._out(1, self.cross_out(a) + x)
        f = self._act(self.ff_in(self._in(2, x)))  # (N, ff)
        return self._out(2, self.ff_out(f) + x)


class _SsruLayer(_Layer):
    """A decoder layer whose self-attention is an SSRU (attnmt.models.ssru):
    f = σ(W_f h + b_f), c_t = f ⊙ c_{t−1} + (1 − f) ⊙ W h, x + ReLU(c_t)."""

    def __init__(self, lean: LeanLayer, pre_norm: bool, activation: str) -> None:
        super().__init__(lean, pre_norm, activation)
        assert lean.ssru is not None
        self.w = _product(lean.ssru)  # W and W_f side by side

    def forward(
        self,
        x: Tensor,
        at: Tensor,
        upto: int,
        self_mask: Tensor,
        previous: Tensor,
        c_out: Tensor,
        memory: tuple[Tensor, Tensor, Tensor],
    ) -> Tensor:
        """x (N, d) -> (N, d); c_{t−1} `previous` (N, d), c_t written into `c_out` (N, d)."""
        wx, gate = self.w(self._in(0, x)).chunk(2, dim=1)  # (N, d) each
        f = torch.sigmoid(gate)
        c = f * previous + (1 - f) * wx
        c_out.copy_(c)
        x = self._out(0, torch.relu(c) + x)
        return self._cross_and_ff(x, memory)


class DecoderLayers(nn.Module):
    """The decoder's layers at one step: x (N, d) -> (N, d), layer i's cache buffers
    caches[2i], caches[2i+1] (keys and values; an SSRU's c_{t−1} and the buffer for c_t) and
    its memory memory[2i], memory[2i+1] (keys, values)."""

    def __init__(self, layers: list[LeanLayer], pre_norm: bool, activation: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            (_SsruLayer if lean.ssru is not None else _Layer)(lean, pre_norm, activation)
            for lean in layers
        )

    def forward(
        self,
        x: Tensor,
        at: Tensor,
        upto: Tensor,
        self_mask: Tensor,
        caches: list[Tensor],
        memory: list[Tensor],
        src_mask: Tensor,
    ) -> Tensor:
        """`upto` (at + 1,): its length says how far the caches are filled after this step
        (a size, which export keeps symbolic; `at` is the tensor index_copy_ takes)."""
        T = upto.size(0)
        torch._check(self_mask.size(-1) <= T)
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, _SsruLayer):
                torch._check(caches[2 * i].size(2) >= T)
            kv = (memory[2 * i], memory[2 * i + 1], src_mask)
            x = layer(x, at, T, self_mask, caches[2 * i], caches[2 * i + 1], kv)
        return x


def covers(layers: list[LeanLayer | None]) -> str | None:
    """Why the compiled step cannot run these layers, or None where it can: self-attention
    with q, k, v stacked or an SSRU, fp32 products with biases or int8 ones (Int8Linear),
    layer norms with both parameters."""
    for lean in layers:
        if lean is None:
            return "rotary positions"
        mix = [lean.ssru] if lean.ssru is not None else [lean.qkv, lean.out]
        products = [*mix, lean.cross_q, lean.cross_out, lean.ff_in, lean.ff_out]
        if any(p is None or not _compilable(p) for p in products):
            return "products that are neither fp32 with a bias nor int8"
        if any(not isinstance(n, nn.LayerNorm) or n.bias is None for n in lean.norms):
            return "norms other than LayerNorm with a bias"
    return None


def _compilable(product: Product) -> bool:
    if product.weight_t is not None:
        return product.bias is not None
    return isinstance(product.module, Int8Linear)


def _examples(module: DecoderLayers, d: int) -> tuple:
    """Inputs to trace with: 6 rows of 3 sentences (2 beams each), 5 positions of 8, 7 source
    positions."""
    first = module.layers[0]
    h = first.heads
    rows, sentences, positions, capacity, source = 6, 3, 5, 8, 7
    caches = [
        torch.zeros(rows, d) if isinstance(layer, _SsruLayer) else
        torch.zeros(rows, h, capacity, d // h)
        for layer in module.layers for _ in range(2)
    ]  # fmt: skip
    memory = [torch.randn(sentences, h, source, d // h) for _ in range(2 * len(module.layers))]
    return (
        torch.randn(rows, d), torch.tensor([positions + 1]), torch.empty(positions + 2),
        torch.zeros(rows, 1, 1, positions), caches, memory, torch.zeros(sentences, 1, 1, source),
    )  # fmt: skip


def _dynamic_shapes(module: DecoderLayers) -> tuple:
    Dim = torch.export.Dim
    n, b = Dim("rows", min=1, max=1 << 16), Dim("sentences", min=1, max=1 << 16)
    t, cap, s = Dim("t", min=1, max=1 << 14), Dim("capacity", min=1, max=1 << 14), Dim("s")
    upto = Dim("upto", min=1, max=1 << 14)
    caches = [
        {0: n} if isinstance(layer, _SsruLayer) else {0: n, 2: cap}
        for layer in module.layers for _ in range(2)
    ]  # fmt: skip
    memory = [{0: b, 2: s}] * (2 * len(module.layers))
    return ({0: n}, None, {0: upto}, {0: n, 3: t}, caches, memory, {0: b, 3: s})


def fingerprint(module: DecoderLayers) -> str:
    """The package's key: the weights, this file, torch, the CPU and whether it runs on one
    thread (serial loops) or several (OpenMP loops, any count)."""
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.contiguous().numpy().tobytes())
    digest.update(Path(__file__).read_bytes())
    threading = "serial" if torch.get_num_threads() == 1 else "parallel"
    machine = f"{torch.__version__} {platform.machine()} {_cpu_name()} {threading}"
    digest.update(f"{module.layers[0].pre_norm} {module.layers[0].activation} {machine}".encode())
    return digest.hexdigest()[:24]


def _cpu_name() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    names = [line.split(":", 1)[1].strip() for line in text.splitlines() if "model name" in line]
    capability = torch.backends.cpu.get_cpu_capability()
    return f"{names[0] if names else platform.processor()} {capability}"


def _compiler_missing() -> str | None:
    """Why Inductor cannot compile here, or None."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None and shutil.which("g++") is None:
        return f"no C++ compiler ({compiler}) on PATH"
    return None


def _compile(module: DecoderLayers, d: int, path: Path) -> None:
    """Export the module and write its AOTInductor package to `path` (atomically). Sizes are
    traced size-obliviously: a size seen as 2 or more in the examples is not taken to be
    other than 1 (one package for greedy rows, a sentence a row, and beams)."""
    with fx_config.patch(backed_size_oblivious=True):
        exported = torch.export.export(
            module, _examples(module, d), dynamic_shapes=_dynamic_shapes(module)
        )
    from torch._inductor import aoti_compile_and_package  # to compile; loading needs none

    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as work:
        made = Path(work) / path.name
        aoti_compile_and_package(
            exported, package_path=str(made), inductor_configs={"freezing": True}
        )
        os.replace(made, path)


class CompiledLayers:
    """A loaded package: called as DecoderLayers.forward. Copies of a model (copy.deepcopy)
    share it.

    It is loaded by torch's C++ loader of AOTInductor packages and run with the flat list of
    inputs it takes (DecoderLayers.forward's arguments in order, the lists' tensors in
    place). torch._inductor.aoti_load_package would import Inductor and read the exported
    program back (2.3 s of a one-line `attnmt translate` against 0.02 s), and its runner
    parses the input and output specs from JSON and flattens the arguments with pytree at
    every call (0.03 ms of a 1-row int8 step's 0.22)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        self.run: Callable[[list[Tensor]], list[Tensor]] = loader.boxed_run

    def __call__(self, *inputs: Tensor | list[Tensor]) -> Tensor:
        flat = [t for x in inputs for t in (x if isinstance(x, list) else (x,))]
        return self.run(flat)[0]

    def __deepcopy__(self, memo: dict) -> CompiledLayers:
        return self


def compiled_layers(
    layers: list[LeanLayer | None], pre_norm: bool, activation: str, d: int, asked: bool = True
) -> CompiledLayers | None:
    """The layers' step compiled (from the cache where it is there), or None with one line on
    stderr saying why decoding keeps the lean step (not `asked`: only where a compiler is
    missing or fails)."""
    if (uncovered := covers(layers)) is not None:
        if asked:
            _say(f"compiled step: not used ({uncovered}); decoding steps as before")
        return None
    module = DecoderLayers([lean for lean in layers if lean is not None], pre_norm, activation)
    path = cache_folder() / f"{fingerprint(module)}.pt2"
    if not path.is_file():
        if (missing := _compiler_missing()) is not None:
            _say(f"compiled step: not used ({missing}); decoding steps as before")
            return None
        start = time.perf_counter()
        _say(f"compiled step: compiling for this model and machine, once (into {path})")
        try:
            with torch.no_grad():
                _compile(module, d, path)
        except Exception as error:
            reason = str(error).strip().splitlines()[0][:200] if str(error) else type(error)
            _say(f"compiled step: not used (the compile failed: {reason}); decoding as before")
            return None
        _say(f"compiled step: compiled in {time.perf_counter() - start:.1f} s")
    try:
        return CompiledLayers(path)
    except Exception as error:
        _say(f"compiled step: not used ({path} could not be loaded: {error}); decoding as before")
        return None


def by_default() -> bool:
    """Whether decoding compiles its step where not told: yes, unless ATTNMT_COMPILE=0 (a test
    suite's or a short job's choice: the first compile of a model takes 15-30 s)."""
    return os.environ.get("ATTNMT_COMPILE", "1").strip().lower() not in ("0", "false", "no", "off")


def attach(model: nn.Module, precision: str, device: str = "cpu", asked: bool = True) -> None:
    """Give each Transformer's lean step (each member of an ensemble) its compiled layers,
    where they can be compiled; else one line on stderr says why (the lean step runs). Not
    `asked` (the default choice): no word where the model is not of the kind it compiles
    (a GRU, rotary positions, bf16, a GPU), only where a compiler is missing or fails."""
    stepping = [
        m for m in model.modules()
        if isinstance(m, TransformerSeq2Seq) and isinstance(m.lean_step, LeanStep)
    ]  # fmt: skip
    why = None if stepping else "it compiles a Transformer's decoder"
    if precision not in ("fp32", "int8") or device != "cpu":
        why = f"fp32 and int8 on the CPU only for now, not {precision} on {device}"
    if why is not None:
        if asked:
            _say(f"compiled step: not used ({why}); decoding steps as before")
        return
    for transformer in stepping:
        lean = transformer.lean_step
        assert isinstance(lean, LeanStep)
        activation = transformer.decoder_layers[0].ff.activation
        d = transformer.tgt_embed.embed.weight.size(1)  # d_model
        lean.compiled = compiled_layers(lean.layers, lean.pre_norm, activation, d, asked)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
