"""Devices, number formats, and what this hardware supports.

The choices themselves are the config's `Literal`s (attnmt.config); this module turns them into
devices and dtypes, and owns the one note a user gets when a number format has no hardware
behind it. Training (attnmt.training) and translation (attnmt.decoding.translator) both ask here.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
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


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (Intel Xeons from Sapphire Rapids on)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else False


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


def cpuinfo_fields(cpuinfo: str | None = None) -> dict[str, str]:
    """The first CPU's `vendor_id` and `flags` from the text of /proc/cpuinfo (read here when
    not given; empty where it cannot be read)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for key, _, value in (line.partition(":") for line in cpuinfo.splitlines()):
        if key.strip() in ("vendor_id", "flags"):
            fields.setdefault(key.strip(), value.strip())
    return fields


def strict_blas_branch(capability: str, vendor: str) -> str | None:
    """The MKL code branch whose strict reproducibility mode fits this CPU (torch's
    get_cpu_capability(), /proc/cpuinfo's vendor_id): AVX-512 on Intel CPUs that have it,
    AVX2 on other x86 CPUs with AVX2 (MKL runs its AVX2 kernels on AMD CPUs anyway), None
    where the mode does not exist (older x86 CPUs, ARM: no MKL)."""
    if capability.startswith("AVX512") and vendor == "GenuineIntel":
        return "AVX512"
    return "AVX2" if capability.startswith(("AVX2", "AVX512")) else None


def reproducible_blas() -> bool:
    """Put MKL in its strict conditional-numerical-reproducibility mode (MKL_CBWR=<branch>,
    STRICT) unless the environment already chose a mode; returns whether a strict mode is on.

    Why: in it MKL's gemm sums in an order that does not depend on the thread count (oneMKL
    developer guide, "Reproducibility Conditions"), which training needs to change its threads
    with the machine's load and still resume byte-identically (kernels.fixed_order does the
    same for torch's own sums). MKL reads the variable once, at its first call: training sets
    it before its first matmul; a process that multiplied before keeps the mode it started in.
    """
    chosen = os.environ.get("MKL_CBWR")
    if chosen is None:
        vendor = cpuinfo_fields().get("vendor_id", "")
        branch = strict_blas_branch(torch.backends.cpu.get_cpu_capability(), vendor)
        if branch is None:
            return False
        chosen = os.environ["MKL_CBWR"] = f"{branch},STRICT"
    return chosen.upper().replace(" ", "").endswith(",STRICT")


def memory_bytes(device: torch.device) -> int:
    """The device's memory: a GPU's total, or the machine's RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class CpuShare:
    """A reading of the CPUs this process may run on: their busy time (steal included: a
    virtual machine's neighbours) from /proc/stat and this process's own CPU time. Between two
    readings, the busy time that is not ours is other processes' load.

    Why: OpenMP threads spin at barriers, and one whose core another process holds stalls every
    step for a scheduler tick; a 2-thread search beside a one-core busy loop kept about 10 % of
    its idle rate, one thread about 60 % (docs/benchmarks.md, "A busy machine"). So attnmt runs
    on the CPUs other processes leave it.
    """

    cpus: tuple[int, ...]
    wall: float  # time.monotonic()
    busy: float  # seconds the CPUs ran anything
    own: float  # seconds this process ran

    @classmethod
    def now(cls) -> CpuShare | None:
        """A reading, or None where /proc/stat is missing (not Linux)."""
        try:
            cpus = tuple(sorted(os.sched_getaffinity(0)))
            lines = Path("/proc/stat").read_text().splitlines()
        except (AttributeError, OSError):
            return None
        ticks = os.sysconf("SC_CLK_TCK")
        busy = 0
        for line in lines[1:]:
            name, *fields = line.split()
            if not name.startswith("cpu"):
                break  # the per-CPU lines come first
            if int(name[3:]) not in cpus:
                continue
            values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
            busy += sum(values) - values[3] - values[4]
        t = os.times()  # with the children it has waited for (forked search workers)
        own = t.user + t.system + t.children_user + t.children_system
        return cls(cpus, time.monotonic(), busy / ticks, own + _live_children_s(ticks))

    def free_since(self, earlier: CpuShare) -> float:
        """How many CPUs other processes left free between `earlier` and this reading."""
        span = self.wall - earlier.wall
        others = (self.busy - earlier.busy) - (self.own - earlier.own)
        return len(self.cpus) - max(0.0, others / span) if span > 0 else float(len(self.cpus))


def _live_children_s(ticks: int) -> float:
    """CPU seconds of this process's children that run or have not been waited for yet (a
    server's forked workers, a store's encoders), theirs and their own waited-for children's:
    os.times() counts a child only once it is reaped, and until then its work looked like
    another process's load. Linux's /proc/PID/task/TID/children; 0 where it is missing."""
    total = 0
    try:
        tasks = list(Path("/proc/self/task").iterdir())
    except OSError:
        return 0.0
    for task in tasks:
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for pid in children:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue  # ended (and reaped) since: os.times() has it
            fields = stat.rsplit(")", 1)[1].split()  # after the command's name
            total += sum(int(v) for v in fields[11:15])  # utime stime cutime cstime
    return total / ticks


def threads_for(free: float, most: int) -> int:
    """Intra-op threads for `free` CPUs: the nearest whole number, at least 1, at most `most`."""
    return max(1, min(most, round(free)))


def free_threads(since: CpuShare | None, most: int, least_s: float = 0.1) -> int:
    """Threads for the CPUs others left free since the reading `since` (at least `least_s`
    ago: waited for, else a scheduler tick would decide), at most `most`; `most` without a
    reading."""
    if since is None:
        return most
    waited = time.monotonic() - since.wall
    if waited < least_s:
        time.sleep(least_s - waited)
    now = CpuShare.now()
    return most if now is None else threads_for(now.free_since(since), most)


@dataclass
class ThreadFit:
    """The CPU intra-op threads of a search or a training run: `fixed` (--threads,
    train.threads), or chosen from the CPUs other processes leave free: first over a reading
    of 0.1 s, then over the time since the last choice, at most every `every_s` seconds
    (None: once)."""

    fixed: int | None
    most: int  # torch's own count: the CPUs there are
    every_s: float | None = 1.0
    reading: CpuShare | None = None  # the last reading (None: the first choice makes one)
    threads: int = 0  # the current choice (0: none yet)

    def apply(self) -> int:
        """Choose (when due) and set the calling thread's intra-op threads; returns them."""
        if self.fixed:
            self.threads = self.fixed
        elif not self.threads:  # since the reading given, or over one of its own
            self.threads = free_threads(self.reading or CpuShare.now(), self.most)
            self.reading = CpuShare.now()
        elif (
            self.every_s is not None
            and self.reading is not None
            and time.monotonic() - self.reading.wall >= self.every_s  # before reading /proc
        ):
            now = CpuShare.now()
            if now is not None:
                self.threads = threads_for(now.free_since(self.reading), self.most)
                self.reading = now
        torch.set_num_threads(self.threads)
        return self.threads
