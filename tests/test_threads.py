"""The CPU threads attnmt runs on: fixed by the user, or as many CPUs as other processes leave
free (attnmt.device.CpuShare, ThreadFit)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from attnmt import Translator
from attnmt.device import CpuShare, ThreadFit, free_threads, threads_for

from helpers import busy_elsewhere

TWO_CPUS = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2
    or CpuShare.now() is None,
    reason="needs two CPUs and /proc/stat",
)  # fmt: skip


def reading(wall: float, busy: float, own: float) -> CpuShare:
    return CpuShare((0, 1), wall, busy, own)


def test_other_processes_load_is_busy_time_less_our_own():
    before = reading(10.0, 100.0, 5.0)
    assert reading(11.0, 100.0, 5.0).free_since(before) == 2.0  # nothing ran
    assert reading(11.0, 102.0, 7.0).free_since(before) == 2.0  # only we ran, on both CPUs
    assert reading(11.0, 101.0, 5.0).free_since(before) == 1.0  # another process held one
    assert reading(12.0, 103.0, 6.0).free_since(before) == 1.0  # one each, over two seconds
    assert reading(10.0, 100.0, 5.0).free_since(before) == 2.0  # no time: no evidence


@pytest.mark.parametrize(
    ("free", "most", "threads"), [(2.0, 2, 2), (1.6, 2, 2), (1.0, 2, 1), (0.2, 2, 1), (7.9, 4, 4)]
)
def test_threads_are_the_free_cpus_rounded_within_bounds(free, most, threads):
    assert threads_for(free, most) == threads


def test_fixed_threads_are_set_whatever_the_load():
    before = torch.get_num_threads()
    try:
        assert ThreadFit(1, 2).apply() == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@TWO_CPUS
def test_a_busy_core_leaves_one_thread():
    with busy_elsewhere(1):  # another program's busy loop
        time.sleep(0.3)  # running
        assert free_threads(CpuShare.now(), 2, least_s=0.5) == 1


def test_a_translator_searches_on_the_threads_it_was_given(trained):
    before = torch.get_num_threads()
    try:
        translator = Translator.load(trained[0], "cpu", threads=1)
        torch.set_num_threads(2)
        translator.translate(["w1 w2"])
        assert torch.get_num_threads() == 1
        with pytest.raises(Exception, match="threads 0"):
            Translator.load(trained[0], "cpu", threads=0)
    finally:
        torch.set_num_threads(before)


def test_the_cli_takes_threads(trained, tmp_path, run_cli):
    r = run_cli("translate", "-m", str(trained[0]), "--threads", "1", stdin=b"w1 w2\n")
    assert r.code == 0 and len(r.stdout.splitlines()) == 1, r.stderr


@TWO_CPUS
def test_our_own_children_are_not_other_processes_load():
    """Issue 77 (also seen): a forked child that runs (not yet waited for) counted as another
    process's load, and its parent gave its CPU away."""
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        before = CpuShare.now()
        time.sleep(1.0)
        after = CpuShare.now()
        assert before is not None and after is not None
        # The child held a CPU for the whole second: ours, so (nearly) every CPU is free.
        assert after.free_since(before) > len(after.cpus) - 0.4
        assert after.own - before.own > 0.8
    finally:
        child.kill()
        child.wait()
