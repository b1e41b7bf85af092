"""Round-robin turns between the processes of benchmarks/compare.py: one training step at a time per mode."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch


class Turns:
    """Round-robin turns between the mode processes: a shared counter says whose step it is."""

    def __init__(self, n: int) -> None:
        context = mp.get_context("spawn")
        self.n = n
        self.turn = context.Value("i", 0)
        self.steps = context.Value("i", 0)  # steps taken by all modes so far: the global order of each step
        self.abort = context.Value("b", 0)
        self.condition = context.Condition()
        self.barrier = context.Barrier(n)

    def gather(self) -> None:
        """Wait until every mode gets here: no mode's timed steps overlap another's start-up or evaluation."""
        self.barrier.wait(timeout=1800)

    def fail(self) -> None:
        """Release the others: this mode's process failed."""
        self.abort.value = 1
        self.barrier.abort()
        with self.condition:
            self.condition.notify_all()

    def wait(self, index: int) -> None:
        with self.condition:
            while self.turn.value != index:
                if self.abort.value:
                    raise RuntimeError("another mode's process failed; stopping this one")
                self.condition.wait(timeout=1.0)

    def take_step(self) -> int:
        with self.condition:
            self.steps.value += 1
            return self.steps.value - 1

    def hand_on(self, index: int) -> None:
        with self.condition:
            self.turn.value = (index + 1) % self.n
            self.condition.notify_all()


class TakeTurns(L.Callback):
    """Times each training step inside mode ``index``'s turn and hands the turn on after it; records the peak CUDA
    memory of training and, with ``profile_path``, a torch.profiler table of steps 8-12."""

    def __init__(self, turns: Turns, index: int, device: str, profile_path: Path | None = None) -> None:
        self.turns, self.index, self.device, self.profile_path = turns, index, device, profile_path
        self.times: list[float] = []
        self.order: list[int] = []
        self.peak = 0
        self.profiler: Any = None

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def on_train_start(self, trainer, module) -> None:
        self.turns.gather()
        self.turns.wait(self.index)
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        if self.profile_path is not None:
            from torch.profiler import ProfilerActivity, profile, schedule

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device == "cuda" else [])
            self.profiler = profile(activities=activities, schedule=schedule(wait=5, warmup=2, active=5))
            self.profiler.start()

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self._sync()
        self.order.append(self.turns.take_step())
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self._sync()
        self.times.append(time.perf_counter() - self._start)
        if self.profiler is not None:
            self.profiler.step()
        self.turns.hand_on(self.index)
        self.turns.wait(self.index)

    def on_train_end(self, trainer, module) -> None:
        if self.device == "cuda":
            self.peak = torch.cuda.max_memory_allocated()
        if self.profiler is not None:
            self.profiler.stop()
            sort = "cuda_time_total" if self.device == "cuda" else "cpu_time_total"
            table = self.profiler.key_averages().table(sort_by=sort, row_limit=30)
            self.profile_path.write_text(table)
        self.turns.hand_on(self.index)
