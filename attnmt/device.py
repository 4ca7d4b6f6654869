"""Devices, number formats, and what this hardware supports.

The choices themselves are the config's `Literal`s (attnmt.config); this module turns them into
devices and dtypes, and owns the one note a user gets when a number format has no hardware
behind it. Training (attnmt.training) and translation (attnmt.decoding.translator) both ask here.
"""

from __future__ import annotations

import os
from typing import get_args

import torch

from attnmt.config import DecodePrecision, DeviceChoice, MatmulChoice, Precision
from attnmt.errors import ConfigError

DEVICES: tuple[str, ...] = get_args(DeviceChoice)
PRECISIONS: tuple[str, ...] = get_args(Precision)
DECODE_PRECISIONS: tuple[str, ...] = get_args(DecodePrecision)
MATMUL_BACKENDS: tuple[str, ...] = get_args(MatmulChoice)

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
assert tuple(PRECISION_DTYPES) == PRECISIONS
# The CPU matmul instructions that cpu_matmul_hardware looks for, as messages name them.
CPU_MATMUL_INSTRUCTIONS = {
    "fp32": "", "bf16": "AMX or AVX512-BF16", "fp16": "AMX-FP16", "int8": "AVX512-VNNI or AVX-VNNI"
}  # fmt: skip
# oneDNN kernels kept for low-precision and oneDNN fp32 CPU matmuls (limit_onednn_kernel_cache).
ONEDNN_CACHE_CAPACITY = 64
ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def choices(values: tuple[str, ...]) -> str:
    """'a, b or c': a list of choices as messages name it."""
    return ", ".join(values[:-1]) + f" or {values[-1]}" if len(values) > 1 else values[0]


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when present; asking for CUDA without one is a config error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = 'cuda': no CUDA device is available (use auto or cpu)")
    return torch.device(name)


def cpu_matmul_hardware(precision: str) -> bool:
    """Whether this CPU has matmul instructions for `precision` ('bf16': AMX or AVX512-BF16;
    'fp16': AMX-FP16; 'int8': VNNI; 'fp32': always). Without them torch emulates the type, far
    slower than fp32 (int8: with wider instructions, less of a gain)."""
    checks = {
        "fp32": (),
        "bf16": ("_is_amx_tile_supported", "_is_avx512_bf16_supported"),
        "fp16": ("_is_amx_fp16_supported",),
        "int8": ("_is_vnni_supported",),
    }[precision]
    if not checks:
        return True
    # torch.cpu's probes are private; a torch without them is treated as lacking the hardware.
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


def resolve_precision(precision: str, device: torch.device) -> str:
    """train.precision as trained: `auto` is bf16 where the device multiplies bf16 natively (a
    CUDA GPU that supports it; a CPU with AMX or AVX512-BF16), fp32 elsewhere."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    return "bf16" if device.type == "cpu" and cpu_matmul_hardware("bf16") else "fp32"


def missing_hardware(device: torch.device, precision: str) -> str | None:
    """The hardware note: what this CPU lacks to compute in `precision`, or None where it has
    it (or the device is not a CPU)."""
    if device.type != "cpu" or cpu_matmul_hardware(precision):
        return None
    return f"this CPU has no {precision} matmul instructions ({CPU_MATMUL_INSTRUCTIONS[precision]})"


def limit_onednn_kernel_cache(device: torch.device, precision: str, backend: str) -> None:
    """Cap the two caches of compiled oneDNN kernels where oneDNN will run the matmuls (CPU,
    16-bit or the onednn backend): oneDNN's own (ONEDNN_PRIMITIVE_CACHE_CAPACITY) and the one
    torch's ideep layer keeps in front of it (LRU_CACHE_CAPACITY), 1,024 entries each by
    default, one per shape. Batches come in hundreds of shapes: with the defaults a bf16 T run
    held 3.0 GB after 250 steps and grew to 4.3 GB in 30 minutes; with both at 64, 1.6 GB and
    2.0 GB, as fast (docs/benchmarks.md). Both are read from the
    environment once, before the first kernel, and torch exports no setter, hence the
    environment writes of the library. A user's own settings win."""
    if device.type == "cpu" and (precision != "fp32" or backend == "onednn"):
        for name in ONEDNN_CACHE_VARIABLES:
            os.environ.setdefault(name, str(ONEDNN_CACHE_CAPACITY))


def memory_bytes(device: torch.device) -> int:
    """The device's memory: a GPU's total, or the machine's RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
