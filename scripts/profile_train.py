#!/usr/bin/env python
"""Where a training step's time goes: torch.profiler over a few steps of a bench config.

    python scripts/profile_train.py [bench.py train's options] [--profile-steps 10]
                                    [--trace FILE.json] [--shapes]

Sets up the run as `attnmt train` does (same config as scripts/bench.py train builds), trains
--warmup steps unprofiled, then --profile-steps under torch.profiler, and prints the operators
by their total device time (CUDA) or CPU time, and the step's wall time. --trace writes a
Chrome trace (chrome://tracing, Perfetto); --shapes adds the operators by input shape.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch
from bench_train import add_train_args, train_config
from torch.profiler import ProfilerActivity, profile

from attnmt.config import from_dict
from attnmt.device import resolve_device
from attnmt.kernels import mask_threads, matmul_backend
from attnmt.training import checkpoints, distributed, runlog, step
from attnmt.training import setup as setup_mod
from attnmt.training.loop import training_matmul


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_train_args(ap)
    ap.add_argument("--profile-steps", type=int, default=10)
    ap.add_argument("--trace", type=Path, help="write a Chrome trace here")
    ap.add_argument(
        "--shapes", action="store_true", help="also the operators by input shape (slower)"
    )
    args = ap.parse_args()
    name = args.configs[0]
    device = resolve_device(args.device)
    with tempfile.TemporaryDirectory(prefix="attnmt-profile-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        cfg = from_dict(train_config(args, name, work))  # --set applied there
        out = work / "model"
        checkpoints.prepare_output_dir(out, overwrite=False, resume=False)
        log = runlog.RunLog(out, quiet=True)
        # The matmul library and dropout-mask threads `attnmt train` uses (training/loop.py).
        backend = stack.enter_context(matmul_backend(training_matmul(cfg, device)))
        print(f"{name}: fp32 matmuls by {backend}")
        stack.enter_context(mask_threads(torch.get_num_threads()))
        run = setup_mod.setup(cfg, out, False, distributed.Ranks(), device, log)
        batches = iter(run.sampler.epoch(1))

        def steps(n: int) -> float:
            start = time.perf_counter()
            for _ in range(n):
                step.train_step(run, [next(batches)], False)
            if device.type == "cuda":
                torch.cuda.synchronize()
            return (time.perf_counter() - start) / n

        steps(args.warmup)
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities, record_shapes=args.shapes) as prof:
            per_step = steps(args.profile_steps)
        sort = "device_time_total" if device.type == "cuda" else "cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=40))
        if args.shapes:
            by_shape = prof.key_averages(group_by_input_shape=True)
            print(by_shape.table(sort_by="self_" + sort, row_limit=30, max_shapes_column_width=90))
        print(f"{name}: {per_step * 1000:.1f} ms a step under the profiler")
        print(f"{name}: {steps(args.profile_steps) * 1000:.1f} ms a step without it")
        if args.trace:
            prof.export_chrome_trace(str(args.trace))
        log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
