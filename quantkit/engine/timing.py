"""Where the engine's time goes, phase by phase; opt-in with QUANTKIT_ENGINE_TIMINGS=1.

On a GPU the engine queues work and waits only where it needs a result, so the wall-clock time between two
points of the code says little about which phase kept the GPU busy. With timings on, the engine waits for its
own CUDA stream at every phase boundary (not for the block being read ahead on the reader's stream) and adds
each phase's seconds to its total; quantize_checkpoint writes the
totals to the run's summary and quant_log.json as "engine_phases". The synchronisations cost a little time,
so timings are off unless asked for (on the CPU they cost nothing).

Phases, per rank:
  capture         running the model up to its first block on the calibration windows
  block_wait      reading a block from the checkpoint, or waiting for the one read ahead
  stats_forwards  the statistics passes (the block's forwards with the collecting hooks)
  stats_reduce    summing the statistics over the ranks (the fixed-order chain of engine.distributed)
  solve           quantizing the linears this rank owns
  share           sending and receiving the ranks' results and putting them in place
  wait            under torchrun, waiting for the other ranks before the two steps above: with timings on,
                  every rank meets the others there (a barrier), so that the two measure their own work; every
                  rank must then see the same setting (torchrun hands its environment to all of them)
  outputs         the quantized block's outputs, the next block's inputs
  finish          dropping the block and recording its tensors (spill, layer checkpoint)
  other           the rest of the engine's time (learning a block's plan, checks)
"""

import os
import time
from contextlib import contextmanager

import torch

ENV = "QUANTKIT_ENGINE_TIMINGS"
PHASES = ("capture", "block_wait", "stats_forwards", "stats_reduce", "solve", "share", "wait", "outputs", "finish")


class EngineTimer:
    """Per-phase seconds of one engine run (see the module docstring); does nothing unless enabled."""

    def __init__(self, device=None, enabled=None):
        self.enabled = os.environ.get(ENV, "") not in ("", "0") if enabled is None else enabled
        self.device = torch.device(device) if device is not None else None
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def _sync(self):
        # the engine's own stream: a device-wide wait would also wait for the block being read ahead on the
        # reader's stream and charge that read to whichever phase is open
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    @contextmanager
    def phase(self, name):
        if not self.enabled:
            yield
            return
        self._sync()  # what was queued before belongs to the phase before
        start = time.perf_counter()
        try:
            yield
        except BaseException:  # no synchronisation: a CUDA error there would hide the one being raised
            self.seconds[name] += time.perf_counter() - start
            raise
        self._sync()
        self.seconds[name] += time.perf_counter() - start

    def wait_for(self, ranks):
        """With timings on, the ranks meet here (phase "wait"); otherwise nothing happens."""
        if self.enabled and ranks.distributed:
            with self.phase("wait"):
                ranks.barrier()

    def report(self, total_seconds) -> dict:
        """{phase: seconds} with "other" = total_seconds less the phases; {} when timings are off."""
        if not self.enabled:
            return {}
        out = {name: round(value, 3) for name, value in self.seconds.items()}
        out["other"] = round(total_seconds - sum(self.seconds.values()), 3)
        return out
