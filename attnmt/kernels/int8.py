"""int8 decoding on the CPU: a trained model's matmuls in 8-bit integers (`--precision int8`).

Dynamic quantization (torch's quantized CPU engine, `x86`: fbgemm's kernels, with oneDNN's for
some shapes): each weight matrix is stored once as int8 with one scale per output row
(per-channel, symmetric), and each call quantizes its input rows to 8 bits with a scale from
their range, multiplies in integers (VNNI's `vpdpbusd` where the CPU has it) and returns fp32:

    y = s_x s_W (q_x q_Wᵀ) + b        q_W = round(W / s_W), s_W = max|W_row| / 127 (per row)

What is swapped, measured on the 30-minute T and R models (docs/benchmarks.md): every linear
layer with at least MIN_OUT_FEATURES outputs (attention projections, feed-forward, the GRU
bridge and pre-output, the output projection over the vocabulary) and the GRUs (their input
and recurrent matmuls). Embeddings stay fp32 (a lookup has no matmul), as do layer norms,
softmax and search. The swap happens on a copy of the weights in place of the modules: the
model can no longer train.

torch marks its quantized tensor types deprecated (a future release removes them); this
project pins torch 2.13, where they are supported.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from attnmt.device import cpu_has_amx
from attnmt.kernels.matmul import side_by_side

# Products with fewer outputs stay fp32: Bahdanau's energy layer (one output) is a
# matrix-vector product bound by memory, where int8 saves nothing.
MIN_OUT_FEATURES = 16

# A call with this many rows or more, and rows x outputs this many or more, takes oneDNN's
# kernels where a layer has both packings (pack_both_ways): measured on a Xeon with AMX, 1 and
# 2 threads, fbgemm is faster below (docs/benchmarks.md).
WIDE_ROWS = 16
WIDE_OUTPUTS = 64 * 768
# Without AMX (VNNI alone: an AMD Zen 4) oneDNN's int8 kernels pass fbgemm's only in large
# products: 1 thread, the output layer (256 -> 8,000) at 64 rows 707 against 821 µs, 160 rows
# 1,809 against 2,688; 256 -> 1,024 at 1,280 rows 1,770 against 3,571; at 36 rows of the
# output layer or 320 of 256 -> 256 about the same (docs/benchmarks.md).
WIDE_OUTPUTS_VNNI = 1 << 18


def int8_hardware() -> bool:
    """Whether this CPU has VNNI (AVX512-VNNI or AVX-VNNI), the 8-bit dot products that make
    int8 matmuls fast; without them fbgemm emulates them with wider instructions."""
    probe = getattr(torch.cpu, "_is_vnni_supported", None)
    return bool(probe()) if probe is not None else False


def int8_tiles() -> bool:
    """Whether this CPU has AMX tiles (Xeons from Sapphire Rapids on), which oneDNN's int8
    matmuls use and fbgemm's do not, and torch has oneDNN's quantized engine."""
    return "onednn" in torch.backends.quantized.supported_engines and cpu_has_amx()


class Int8Linear(nn.Module):
    """y = x Wᵀ + b with W (N, K) stored as int8, one scale per row, and x quantized per call."""

    def __init__(self, q_weight: torch.Tensor, bias: torch.Tensor | None, full_range: bool) -> None:
        super().__init__()
        self.packed = torch.ops.quantized.linear_prepack(q_weight, bias)
        self.engine = torch.backends.quantized.engine  # whose kernels `packed` is for
        self.q_weight, self.bias = q_weight, bias  # kept for rows()
        self.out_features, self.in_features = q_weight.shape
        # 7-bit inputs (reduce_range) keep fbgemm's 16-bit sums from saturating without VNNI.
        self.reduce_range = not full_range
        # The same weights packed for oneDNN too (pack_both_ways), for calls with many rows:
        # from WIDE_ROWS rows and `wide_outputs` rows x outputs on.
        self.wide: torch.Tensor | None = None
        self.wide_outputs = WIDE_OUTPUTS

    @classmethod
    def quantize(cls, linear: nn.Linear, full_range: bool) -> Int8Linear:
        """linear's weight in int8, one symmetric scale per output row."""
        w = linear.weight.detach().float()  # (N, K)
        scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()  # (N,)
        zeros = torch.zeros(w.size(0), dtype=torch.long)
        q_w = torch.quantize_per_channel(w, scales, zeros, 0, torch.qint8)
        bias = None if linear.bias is None else linear.bias.detach().float()
        return cls(q_w, bias, full_range)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) -> (..., N)."""
        packed = self.packed
        if self.wide is not None:
            rows = x.numel() // self.in_features
            if rows >= WIDE_ROWS and rows * self.out_features >= self.wide_outputs:
                packed = self.wide
        return torch.ops.quantized.linear_dynamic(x, packed, self.reduce_range)

    def rows(self, index: torch.Tensor) -> Int8Linear:
        """The layer of output rows `index` only (a lexical shortlist's output projection): the
        same int8 rows and scales, packed anew (about 3 ms for 1,500 x 256) for fbgemm only (a
        second packing would double that for each batch's rows)."""
        q = self.q_weight
        q_rows = _per_channel(
            q.int_repr().index_select(0, index),
            q.q_per_channel_scales().index_select(0, index),
            q.q_per_channel_zero_points().index_select(0, index),
        )
        bias = None if self.bias is None else self.bias.index_select(0, index)
        return Int8Linear(q_rows, bias, not self.reduce_range)

    @classmethod
    def stacked(cls, layers: list[Int8Linear]) -> Int8Linear:
        """One layer computing the outputs of `layers` (same inputs) side by side: their int8
        rows and scales stacked, so each output equals its own layer's (the input is quantized
        once for all: the same scale as each would give it)."""
        qs = [layer.q_weight for layer in layers]
        q = _per_channel(
            torch.cat([x.int_repr() for x in qs]),
            torch.cat([x.q_per_channel_scales() for x in qs]),
            torch.cat([x.q_per_channel_zero_points() for x in qs]),
        )
        bias = side_by_side([m.bias for m in layers], [m.out_features for m in layers])
        both = Int8Linear(q, bias, not layers[0].reduce_range)
        if layers[0].wide is not None:  # packed both ways as they were
            both.wide, both.wide_outputs = both.packed_for("onednn"), layers[0].wide_outputs
        return both

    def repack(self, engine: str) -> None:
        """Pack the weight again for `engine`'s kernels."""
        self.packed, self.engine, self.wide = self.packed_for(engine), engine, None

    def packed_for(self, engine: str) -> torch.Tensor:
        """The weight packed for `engine`'s kernels: torch's quantized engine (a process-wide
        setting, read when weights are packed) is switched for the call."""
        before = torch.backends.quantized.engine
        torch.backends.quantized.engine = engine
        try:
            return torch.ops.quantized.linear_prepack(self.q_weight, self.bias)
        finally:
            torch.backends.quantized.engine = before


def _per_channel(
    int_repr: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor
) -> torch.Tensor:
    """An int8 weight (N, K) with one scale and zero point per output row (axis 0)."""
    return torch._make_per_channel_quantized_tensor(int_repr, scales, zero_points, 0)


class Int8GRU(torch.ao.nn.quantized.dynamic.GRU):
    """torch's dynamically quantized GRU, which also answers `all_weights` with nothing: the
    fused training recurrences (attnmt.kernels) that read a GRU's weights then stand aside."""

    @property
    def all_weights(self) -> list[list[torch.Tensor]]:
        return []


def quantize_int8(model: nn.Module) -> nn.Module:
    """The model (fp32, on the CPU) with its linear layers and GRUs swapped, in place, for int8
    ones; returns it, in eval mode."""
    model.eval()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantized tensor creation.*deprecated")
        warnings.filterwarnings("ignore", message=".*quantiz.*", category=DeprecationWarning)
        _swap(model, int8_hardware())
    return model


def pack_for_many_rows(modules: Iterable[nn.Module]) -> None:
    """Where the CPU has AMX tiles, repack the Int8Linear layers in `modules`, which multiply
    a whole batch of sources at once, for oneDNN's kernels: 2.3x fbgemm's at 1,280 rows x 256
    -> 1,024 on a Xeon with AMX, but slower at a decoding step's few rows, which stay with
    fbgemm (docs/benchmarks.md). The weights stay the same int8 rows and scales."""
    for layer in _to_pack(modules, int8_tiles()):
        layer.repack("onednn")


def pack_both_ways(modules: Iterable[nn.Module]) -> None:
    """Where the CPU has AMX tiles, give the Int8Linear layers in `modules` (a decoder's,
    whose calls have from one row to hundreds: beam search's K per sentence) the same weights
    packed for oneDNN too, which their calls take from WIDE_ROWS rows and WIDE_OUTPUTS outputs
    on: the output layer (N × 256 × 8,000, 1 thread) at 36 rows 0.55 -> 0.30 ms, 320 rows 3.3
    -> 1.1 ms, while at a few rows fbgemm's stay faster (docs/benchmarks.md). Where it has
    VNNI and no AMX, likewise from WIDE_OUTPUTS_VNNI outputs on (the encoder's layers too)."""
    amx = int8_tiles()
    vnni = int8_hardware() and "onednn" in torch.backends.quantized.supported_engines
    for layer in _to_pack(modules, amx or vnni):
        if layer.engine != "onednn":
            layer.wide = layer.packed_for("onednn")
            layer.wide_outputs = WIDE_OUTPUTS if amx else WIDE_OUTPUTS_VNNI


def _to_pack(modules: Iterable[nn.Module], where: bool) -> Iterator[Int8Linear]:
    """The Int8Linear layers in `modules` if `where` (none otherwise), with torch's warnings
    about quantized tensors silenced while the caller packs each."""
    if not where:
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantiz.*")
        for module in modules:
            for layer in module.modules():
                if isinstance(layer, Int8Linear):
                    yield layer


def _swap(module: nn.Module, full_range: bool) -> None:
    dynamic = torch.ao.nn.quantized.dynamic
    qconfig = torch.ao.quantization.default_dynamic_qconfig
    for name, child in module.named_children():
        if isinstance(child, nn.Linear) and child.out_features >= MIN_OUT_FEATURES:
            setattr(module, name, Int8Linear.quantize(child, full_range))
        elif isinstance(child, nn.GRU):
            child.qconfig = qconfig  # type: ignore[assignment]
            quantized = dynamic.GRU.from_float(child)
            quantized.__class__ = Int8GRU
            setattr(module, name, quantized)
        else:
            _swap(child, full_range)
