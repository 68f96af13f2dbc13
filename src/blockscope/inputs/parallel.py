"""Runs across processes: which documents this process scores, and how its sums join.

Under `torchrun --nproc-per-node N` (WORLD_SIZE > 1 in the environment) `from_env` joins
the process group (gloo on CPUs, NCCL on GPUs) and returns a `Comm` for it; otherwise the
single-process `Comm`, whose collectives return their input. Documents go to ranks in turn
(document i to rank i mod N), every rank gathers every rank's per-document parts, sorted by
document and added in that order in float64 (`total`), so all ranks compute the same table,
float for float the table one process computes, and rank 0 alone writes it. This is the
data-parallel pattern of lm-evaluation-harness under `accelerate launch`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Comm:
    """A single process: every collective returns its input."""

    rank: int = 0  # this process's rank
    size: int = 1  # number of processes
    backend: str | None = None  # "gloo" / "nccl" when distributed

    def gather(self, obj) -> list:
        """Every process's `obj`, in rank order, on every process."""
        return [obj]

    def owns(self, i: int) -> bool:
        """Whether this process scores document i."""
        return i % self.size == self.rank

    @property
    def writes(self) -> bool:
        """Whether this process prints and writes the results (rank 0)."""
        return self.rank == 0


@dataclass(frozen=True)
class DistComm(Comm):
    """One process of a torch.distributed group (objects gathered are pickled: keep
    tensors on the CPU)."""

    def gather(self, obj) -> list:
        import torch.distributed as dist

        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out


def in_order(comm: Comm, parts: list[tuple[int, object]]) -> list:
    """Every process's `(index, value)` parts (an index: a document's or a fact's place in
    the corpus), their values in index order, on every process: the order one process
    would have made them in, whatever the number of processes."""
    gathered = [p for part in comm.gather(list(parts)) for p in part]
    return [value for _, value in sorted(gathered, key=lambda p: p[0])]


def total(comm: Comm, parts: list[tuple[int, object]]):
    """The sum of every process's `(index, value)` parts (a number, a tensor or a dict of
    tensors) in float64 on the CPU, added one by one in index order from zero: the same
    floats from one process as from N ranks, since neither the grouping nor the order of
    the additions depends on which rank holds which part. None when no process has a part."""
    import torch

    values = in_order(comm, parts)
    if not values:
        return None

    def f64(v):
        return torch.as_tensor(v).detach().to("cpu", torch.float64)

    if isinstance(values[0], dict):
        out = {k: torch.zeros_like(f64(v)) for k, v in values[0].items()}
        for v in values:
            for k in out:
                out[k] += f64(v[k])
        return out
    out = torch.zeros_like(f64(values[0]))
    for v in values:
        out += f64(v)
    return out


def world_size() -> int:
    """The number of processes torchrun started (1 without torchrun)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def env_rank() -> int:
    """This process's rank as torchrun set it (0 without torchrun)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def from_env(device: str) -> Comm:
    """The process group torchrun describes, joined once; a single-process Comm without it.

    `device` is where this process's model runs: NCCL for CUDA devices, gloo otherwise."""
    if world_size() == 1:
        return Comm()
    import torch
    import torch.distributed as dist

    cuda = device.startswith("cuda")
    backend = "nccl" if cuda else "gloo"
    if not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(torch.device(device))
        dist.init_process_group(backend=backend)
    return DistComm(rank=dist.get_rank(), size=dist.get_world_size(), backend=backend)


def local_device(device: str) -> str:
    """Under torchrun, `auto`/`cuda` mean this process's own GPU (cuda:LOCAL_RANK)."""
    if world_size() == 1 or device not in ("auto", "cuda"):
        return device
    import torch

    if not torch.cuda.is_available():
        return "cpu" if device == "auto" else device
    return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"


def finish() -> None:
    """Leave the process group, if one was joined."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def report_failure(line: str) -> None:
    """Under torchrun, leave this process's one-line failure where torchrun's summary reads
    it (TORCHELASTIC_ERROR_FILE), so its "Root Cause" names blockscope's reason instead of
    pointing at the elastic docs. torchrun's launcher still prints its own traceback above
    the summary whenever a process exits non-zero: that is torchrun's, not this process's."""
    import json
    import time

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": line,
                        "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as fp:
            json.dump(data, fp, allow_nan=False)
    except OSError:
        pass  # torchrun's summary falls back to its generic line; stderr has the reason
