"""Speed code: fused CPU ops with hand-written backward, the CPU fp32 matmul backend, and the
fast forms of attention and of search's per-row argmax/top-k.

Each function takes tensors (never a model's modules), computes the same thing as its plain
PyTorch form (the tests compare them), and decides itself whether its fast path applies: off
the CPU, under autocast or torch.compile it falls back to the plain ops where those are as fast,
or returns None where the caller's own equations are the faster way. What each one gains on a
whole training step, and how that was measured, is in docs/benchmarks.md ("What the kernels
gain").

    Linear, matmul_backend       the fp32 CPU matmuls of the linear layers: MKL or oneDNN
    linear_cross_entropy         output projection + label-smoothed cross-entropy, chunked
    feed_forward, dropout_add    the Transformer's FFN and residual dropout, fused on CPU
    Dropout, dropout             dropout with a cheaper CPU mask (mask_threads: its threads)
    fused_attention              scaled dot-product attention in torch's fused kernel, or
                                 head by head (training on CPU with attention dropout)
    step_attention               a decoding step's attention: one query a row over few keys
                                 by element-wise sums on CPU, else batched products (the
                                 lean step)
    gru_attention_recurrence     the rnn decoder's recurrence (BPTT by hand), teacher-forced
                                 or choosing scheduled sampling's inputs as it runs
    bigru_recurrence             the rnn encoder's one-layer bidirectional GRU
    argmax_rows, topk_rows       search's choice of tokens, vectorised on CPU
    LayerNorm, softmax,          sums in an order the thread count does not change: a
    clip_grad_norm               training step computes the same bits on 1 thread as on 2

Imports only the ground floor (device): the models call it, it calls no model.
"""

from attnmt.kernels.attention import fused_attention
from attnmt.kernels.fixed_order import LayerNorm, clip_grad_norm, softmax
from attnmt.kernels.int8 import pack_for_many_rows, quantize_int8
from attnmt.kernels.matmul import Linear, matmul_backend
from attnmt.kernels.ops import (
    Dropout,
    dropout,
    dropout_add,
    feed_forward,
    linear_cross_entropy,
    mask_threads,
)
from attnmt.kernels.recurrence import (
    ScheduledSampling,
    bigru_recurrence,
    gru_attention_recurrence,
    plain_recurrences,
)
from attnmt.kernels.topk import argmax_rows, topk_rows

__all__ = [
    "Dropout",
    "LayerNorm",
    "Linear",
    "ScheduledSampling",
    "argmax_rows",
    "bigru_recurrence",
    "clip_grad_norm",
    "dropout",
    "dropout_add",
    "feed_forward",
    "fused_attention",
    "gru_attention_recurrence",
    "linear_cross_entropy",
    "mask_threads",
    "matmul_backend",
    "pack_for_many_rows",
    "plain_recurrences",
    "quantize_int8",
    "softmax",
    "topk_rows",
]
