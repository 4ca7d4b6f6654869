"""Data-parallel training across processes (PyTorch DDP), started by torchrun.

`torchrun --nproc_per_node N -m attnmt train ...` sets RANK, LOCAL_RANK and WORLD_SIZE in each
process's environment; without them training runs in one process and nothing here does
anything. Each rank trains on its own share of every group of batches, DDP averages the
gradients, and only rank 0 writes files and logs (see train.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum of `values` over all ranks (the same list on every rank)."""
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def weights_identical(self, model: torch.nn.Module) -> bool:
        """Whether every rank holds the same weights (compares a float64 checksum): DDP keeps
        them in step, and a difference means the ranks went out of sync."""
        if self.world == 1:
            return True
        total = sum(float(p.detach().double().sum()) for p in model.parameters())
        t = torch.tensor([total, -total], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t[0] == -t[1])

    def shutdown(self, finished: bool) -> None:
        """Leave the process group. A rank that `finished` waits until every rank has: none
        tears its connections down while another still uses them."""
        if self.world > 1 and dist.is_initialized():
            if finished:
                dist.barrier()
            dist.destroy_process_group()


def ranks_from_env() -> Ranks:
    """The ranks torchrun describes in the environment, or a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Ranks()
    return Ranks(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")))


def init(ranks: Ranks, device: torch.device) -> torch.device:
    """Join the process group (NCCL on CUDA, gloo on CPU); returns this rank's device (its own
    GPU, LOCAL_RANK, when `device` is CUDA)."""
    if device.type == "cuda":
        device = torch.device("cuda", ranks.local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # Metadata collectives (sums, barriers) run on CPU tensors: gloo serves those, NCCL the
        # gradients on CUDA.
        dist.init_process_group(backend="cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
    return device


def step_seed(seed: int, rank: int, step: int) -> int:
    """The RNG seed of one rank at one step of a multi-process run.

    Each rank must draw different dropout masks, and a resumed run must draw the same ones it
    would have drawn without the interruption, on every rank: a pure function of
    (seed, rank, step) gives both without saving every rank's RNG state.
    """
    return (seed * 1_000_003 + rank * 7_919 + step) % (2**63)
