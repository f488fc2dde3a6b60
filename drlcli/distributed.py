"""Multi-process execution under ``torchrun`` (DistributedDataParallel), and the single-process case.

Every function works unchanged in one process (world size 1), so the stage loop has one code
path. ``torchrun --nproc_per_node K -m drlcli ...`` sets RANK/WORLD_SIZE/LOCAL_RANK; ``setup``
then joins the process group (NCCL on CUDA, gloo on CPU). Rank 0 alone takes the writer lock,
writes the run directory and prints; every collective here is called by all ranks in the same
order. A rank that fails exits non-zero and torchrun stops the others.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from .errors import UsageError


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_main() -> bool:
    return rank() == 0


def launched() -> bool:
    """True when started by torchrun (or any launcher) with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def setup(*, cpu: bool = False) -> None:
    """Join the process group if launched with several processes (devices: ``api.resolve_device``)."""
    if not launched() or dist.is_initialized():
        return
    use_cuda = not cpu and torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    timeout = datetime.timedelta(seconds=float(os.environ.get("DRL_DIST_TIMEOUT", "1800")))
    kwargs: dict[str, Any] = {}
    if use_cuda:
        local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(local)
        kwargs["device_id"] = local  # binds NCCL to this GPU up front (recent torch warns without it)
    dist.init_process_group(backend=backend, timeout=timeout, **kwargs)


EXIT_KEY = "drl/exit"
EXIT_WAIT_S = 120.0


def teardown(*, clean: bool = False) -> None:
    """Leave the process group. After a clean finish every rank first waits, through the
    launcher's store rather than gloo or NCCL, until all ranks have got here (at most
    EXIT_WAIT_S): a rank that closed its connections while a peer's last collective still read
    from them could abort that peer (pytorch/gloo#155). A rank that failed leaves at once;
    torchrun stops the others."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if clean and world_size() > 1:
        wait_for_every_rank(EXIT_KEY, timeout_s=EXIT_WAIT_S)
    dist.destroy_process_group()


def wait_for_every_rank(key: str, *, timeout_s: float) -> None:
    """Count this rank in at ``key`` of the default store and wait until every rank has, or until
    ``timeout_s`` has passed."""
    store = dist.distributed_c10d._get_default_store()
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while store.add(key, 0) < world_size() and time.monotonic() < deadline:
        time.sleep(0.02)


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (in place on a copy); the tensor itself in one process."""
    if world_size() == 1:
        return tensor
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    out = tensor.to(device).clone()
    dist.all_reduce(out)
    return out.to(tensor.device)


def all_gather_objects(obj: Any) -> list[Any]:
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (in-memory between our own processes, never from disk)."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shard(n: int) -> list[int] | None:
    """This rank's share of range(n), every index exactly once over all ranks; None (all of
    them) in one process."""
    return list(range(rank(), n, world_size())) if world_size() > 1 else None


def local_batch_size(global_batch: int) -> int:
    world = world_size()
    if global_batch % world:
        raise UsageError(
            f"--batch-size {global_batch} is the global batch and must divide by the {world} processes; "
            f"use a multiple of {world}"
        )
    return global_batch // world
