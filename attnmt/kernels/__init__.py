"""Speed code: fused CPU ops with hand-written backward, and the CPU fp32 matmul backend.

Each op computes the same thing as its plain PyTorch form (the tests compare them) and is
called once from the model code; off the CPU, under autocast or torch.compile they fall back
to the plain ops where those are as fast. What each one gains on a whole training step, and
how that was measured, is in docs/benchmarks.md ("What the kernels gain").

    Linear, matmul_backend       the fp32 CPU matmuls of the linear layers: MKL or oneDNN
    linear_cross_entropy         output projection + label-smoothed cross-entropy, chunked
    feed_forward, dropout_add    the Transformer's FFN and residual dropout, fused on CPU
    Dropout, dropout             dropout with a cheaper CPU mask
    gru_attention_recurrence     the rnn decoder's recurrence (BPTT by hand), teacher-forced
                                 or choosing scheduled sampling's inputs as it runs
    bigru_recurrence             the rnn encoder's one-layer bidirectional GRU
"""

from attnmt.kernels.matmul import (
    BACKENDS,
    CPU_MATMUL_INSTRUCTIONS,
    PRECISION_DTYPES,
    Linear,
    cpu_matmul_hardware,
    limit_onednn_kernel_cache,
    matmul_backend,
)
from attnmt.kernels.ops import Dropout, dropout, dropout_add, feed_forward, linear_cross_entropy
from attnmt.kernels.recurrence import (
    ScheduledSampling,
    bigru_recurrence,
    gru_attention_recurrence,
)

__all__ = [
    "BACKENDS",
    "CPU_MATMUL_INSTRUCTIONS",
    "PRECISION_DTYPES",
    "Dropout",
    "Linear",
    "ScheduledSampling",
    "bigru_recurrence",
    "cpu_matmul_hardware",
    "dropout",
    "dropout_add",
    "feed_forward",
    "gru_attention_recurrence",
    "limit_onednn_kernel_cache",
    "linear_cross_entropy",
    "matmul_backend",
]
