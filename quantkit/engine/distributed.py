"""Quantization spread over the ranks of one host (torch.distributed: NCCL on GPUs, gloo on CPU).

Launched by torchrun (env RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), e.g.
    torchrun --standalone --nproc-per-node 2 -m quantkit quantize --model M --method gptq --out OUT
Each rank holds the whole (CPU) model and its own share of the calibration windows:
  * calibration: rank r runs the layer on windows [r·n/W, (r+1)·n/W) only;
  * statistics: the Σ xᵀx of every rank is combined into the one Hessian every rank then uses;
  * quantization: the linears of a layer are dealt round-robin; each rank quantizes all of its
    linears of a sequential group (so the ranks work at once), then the owners broadcast the stored
    tensors in the group's order and every rank puts the same dequantized weights back for the next
    forward (engine.driver._quantize_together);
  * rank 0 writes checkpoints' quantized tensors, the artifact and the log.

Identity with one process. fp32 addition is not associative, so "sum the per-rank partial sums" gives
a different Hessian (in the last bits, hence different codes) for every world size. The sum is
therefore defined once, independently of W:
    H = ((((0 + S_0) + S_1) + S_2) ... + S_7),  S_j = Σ of xᵀx over the windows of shard j,
with the n windows cut into SHARDS = 8 contiguous shards (shard j = windows [j·n/8, (j+1)·n/8)),
each S_j accumulated from zero in window order (fp32 addmm, as one process does). Rank r owns the
shards [r·8/W, (r+1)·8/W), computes their S_j in parallel with the other ranks, and the running total
passes from rank to rank in shard order (`ordered_sum`): the same additions in the same order as one
process, so the Hessian is equal bit for bit. Hence W must divide 8 (1, 2, 4 or 8 ranks), and
n >= W. Cost: rank 0 folds its shards as they finish (one d×d buffer beside the shard being
accumulated, as one process does); rank r > 0 keeps its 8/W shard sums until the running total
arrives (8/W + 2 buffers of d×d fp32; for W = 2 and Llama-2-7B's down_proj, d = 11008, 2.4 GB).
The chain's W − 1 sends of d×d fp32 are short next to the forward passes they parallelise.
Everything else a rank computes (per-window forwards, GEMMs, quantization) is the same kernel on the
same inputs as in one process, so results are identical as long as those kernels are deterministic
(cuBLAS GEMMs and the PyTorch ops the methods use are, on one GPU model).

Messages between ranks are tensors and JSON (no pickle): a header is a UTF-8 JSON byte tensor.
"""

import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from quantkit.errors import QuantkitError

SHARDS = 8
TIMEOUT = timedelta(minutes=60)
SHUTDOWN_TIMEOUT = timedelta(minutes=1)


def shard_bounds(n):
    """Window index bounds of the SHARDS canonical shards of n windows (shard j: [b[j], b[j+1]))."""
    return [j * n // SHARDS for j in range(SHARDS + 1)]


class Ranks:
    """This process's place in the job and the collectives the engine needs. World size 1 (a plain
    run) uses the same object, with collectives that do nothing."""

    def __init__(self, rank=0, world_size=1, device="cpu"):
        if SHARDS % world_size:
            raise QuantkitError(f"quantization runs on 1, 2, 4 or 8 ranks (the Hessian is summed over {SHARDS} "
                                f"fixed shards of the calibration windows); got a world size of {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.device = device  # where this rank computes; NCCL messages travel from/to it
        self.comm_device = device if str(device).startswith("cuda") else "cpu"

    @property
    def is_main(self):
        return self.rank == 0

    @property
    def distributed(self):
        return self.world_size > 1

    # --- the split of the calibration windows -------------------------------------------------

    def shards_of(self, rank):
        per = SHARDS // self.world_size
        return range(rank * per, (rank + 1) * per)

    def window_range(self, n, rank=None):
        """[start, stop) of the windows of `rank` (default: this rank)."""
        bounds = shard_bounds(n)
        shards = self.shards_of(self.rank if rank is None else rank)
        return bounds[shards.start], bounds[shards.stop]

    def local_shard_sizes(self, n):
        """Window counts of this rank's non-empty shards, in order."""
        bounds = shard_bounds(n)
        sizes = [bounds[j + 1] - bounds[j] for j in self.shards_of(self.rank)]
        return [s for s in sizes if s]

    def owner(self, index):
        """The rank that quantizes the linear with global position `index`."""
        return index % self.world_size

    # --- collectives -------------------------------------------------------------------------

    def ordered_sum(self, prefix, parts):
        """The canonical total of the shard sums (module docstring). Rank 0 passes `prefix`, its
        shards already folded onto zero in order; rank r > 0 passes `parts`, its shard sums in order."""
        if not self.distributed:
            return prefix
        if self.rank == 0:
            total = prefix
            dist.send(total, dst=1)
        else:
            total = torch.empty_like(parts[0])
            dist.recv(total, src=self.rank - 1)
            for part in parts:
                total.add_(part)
            if self.rank < self.world_size - 1:
                dist.send(total, dst=self.rank + 1)
        dist.broadcast(total, src=self.world_size - 1)
        return total

    def sum_int(self, value: int) -> int:
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.comm_device)
        dist.all_reduce(t)
        return int(t.item())

    def all_ok(self, ok: bool) -> bool:
        """True when `ok` holds on every rank (every rank must call it)."""
        if not self.distributed:
            return ok
        t = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def barrier(self):
        if self.distributed:
            self.all_ok(True)

    def broadcast_json(self, obj, src=0):
        """`obj` (JSON-able) from rank `src` to every rank; other ranks pass None."""
        if not self.distributed:
            return obj
        payload = json.dumps(obj).encode() if self.rank == src else b""
        size = torch.tensor([len(payload)], dtype=torch.int64, device=self.comm_device)
        dist.broadcast(size, src=src)
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=self.comm_device)
        if self.rank == src:
            buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        dist.broadcast(buf, src=src)
        return json.loads(buf.cpu().numpy().tobytes().decode())

    def broadcast_tensors(self, tensors, spec, src):
        """{name: tensor} from `src`; receivers allocate from spec [[name, dtype, shape]]. CPU tensors out."""
        out = {}
        for name, dtype, shape in spec:
            if self.rank == src:
                t = tensors[name].to(self.comm_device).contiguous()
            else:
                t = torch.empty(shape, dtype=getattr(torch, dtype), device=self.comm_device)
            dist.broadcast(t, src=src)
            out[name] = t.to("cpu")
        return out

    def run_on_main(self, fn):
        """fn() on rank 0, its JSON-able result given to every rank; a QuantkitError raised there is
        raised on every rank (so no rank waits forever for one that failed)."""
        result, error, failure = None, None, None
        if self.is_main:
            try:
                result = fn()
            except QuantkitError as exc:
                error, failure = str(exc), exc
        if self.distributed:
            result, error = self.broadcast_json([result, error], src=0)
        if failure is not None:
            raise failure  # rank 0 keeps the precise type (StorageError, CheckpointError)
        if error is not None:
            raise QuantkitError(error)
        return result


LOCAL = Ranks()


def env_world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError as exc:
        raise QuantkitError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer") from exc


def init_from_env(device: str) -> Ranks:
    """A Ranks for this process: LOCAL without torchrun, else join the process group (NCCL when
    `device` is cuda, each rank on cuda:LOCAL_RANK; gloo on CPU)."""
    world = env_world_size()
    if world <= 1:
        return LOCAL
    if SHARDS % world:
        Ranks(world_size=world)  # raises the message about supported world sizes
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if str(device).startswith("cuda"):
        if local_rank >= torch.cuda.device_count():
            raise QuantkitError(f"rank {rank} needs cuda:{local_rank} but only {torch.cuda.device_count()} "
                                "GPUs are visible")
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(local_rank)
        backend = "nccl"
    else:
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=TIMEOUT)
    return Ranks(rank, world, device)


def shutdown(ranks: Ranks):
    if ranks.distributed and dist.is_initialized():
        # gloo ranks leave together: one tearing down while its peer still talks to it was seen to abort
        # at exit ("terminate called without an active exception"). A peer that is gone, or does not
        # arrive within the minute, makes the barrier fail, which must not hide an error being raised.
        if dist.get_backend() == "gloo":
            try:
                dist.monitored_barrier(timeout=SHUTDOWN_TIMEOUT)
            except Exception:  # noqa: BLE001
                pass
        dist.destroy_process_group()
