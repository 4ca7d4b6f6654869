"""A model made ready to translate in a number format (fp32, bf16, fp16, int8): for_decoding."""

from __future__ import annotations

from typing import cast

import torch

from attnmt.device import PRECISION_DTYPES, cpu_has_amx
from attnmt.kernels import pack_for_many_rows, quantize_int8
from attnmt.kernels.int8 import pack_both_ways
from attnmt.kernels.matmul import column_major_weights, onednn_packed_weights
from attnmt.models import compiled_step, lean_step
from attnmt.models.seq2seq import Seq2Seq
from attnmt.models.transformer import TransformerSeq2Seq


def for_decoding(model: Seq2Seq, precision: str, compile: bool | None = False) -> Seq2Seq:
    """The model, in place, with its weights and buffers in `precision` for translation: the
    16-bit formats halve the weights' memory traffic and run on the hardware's 16-bit matmuls
    (GPU tensor cores, AMX); int8 (CPU) swaps the matmuls for 8-bit ones (kernels.int8); all
    at the cost of outputs that may differ from fp32 here and there. Search sums its scores in
    fp32 whatever the model computes in. fp32 weights are stored column-major
    (column_major_weights) and, where oneDNN runs the larger products, also in its layout
    (onednn_packed_weights), and a Transformer on the CPU steps with fewer operations
    (models.lean_step): the same outputs up to float rounding; with `compile`, its decoder's
    layers compiled ahead of time where they can be (models.compiled_step; None: where it
    applies unless ATTNMT_COMPILE=0, without a word where it does not). Move the model to its
    device first."""
    if precision == "int8":
        model = cast(Seq2Seq, quantize_int8(model.float()))
        pack_for_many_rows(model.source_side())
        pack_both_ways([model])  # the rest (the decoder's): by each call's rows
        # Attention's keys and values in bf16, half the bytes: faster with AMX (a Xeon: greedy
        # +12 %), slower with AVX512-BF16 alone (Zen 4: greedy -17 %; docs/benchmarks.md).
        if cpu_has_amx():
            for module in model.modules():
                if isinstance(module, TransformerSeq2Seq):
                    module.cache_dtype = torch.bfloat16
    else:
        model = column_major_weights(model.to(PRECISION_DTYPES[precision]))
        onednn_packed_weights(model)  # where oneDNN runs the larger products
    device = next(model.parameters(), torch.empty(0)).device.type
    if device == "cpu":
        lean_step.attach(model)  # (on a GPU not measured)
    if compile or (compile is None and compiled_step.by_default()):
        compiled_step.attach(model, precision, device, asked=bool(compile))
    return model
