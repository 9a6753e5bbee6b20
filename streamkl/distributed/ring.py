"""The process group as a ring: peers, overlapped point-to-point exchange, and one agreement step.

Rank r sends to r + 1 and receives from r - 1 (mod P); at ring step t it holds the shard of rank
r - t. Transfers for the next step are posted before the current step computes
(`torch.distributed.batch_isend_irecv`) and waited after it, so communication hides behind work.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch
import torch.distributed as dist

#: message tags: key shards and gradient accumulators travel on separate channels (gloo matches
#: point-to-point messages by source and tag)
KEYS_TAG = 0
GRADS_TAG = 1


def _fail(function: str, argument: str, expected: str, got: object, cls: type[Exception] = ValueError):
    raise cls(f"streamkl.distributed.{function}: `{argument}` must be {expected}; got {got}.")


def resolve_group(group: object, function: str):
    """The process group to use (None: the default one), checked without communicating."""
    if not dist.is_available():
        _fail(function, "group", "a process group of torch.distributed (not available in this torch build)", None)
    if not dist.is_initialized():
        _fail(function, "group", "a process group of an initialized torch.distributed "
              "(call torch.distributed.init_process_group first)", group)
    if group is None:
        group = dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        _fail(function, "group", "a torch.distributed.ProcessGroup or None", type(group).__name__, TypeError)
    if dist.get_rank(group) < 0:
        _fail(function, "group", "a process group this process belongs to", "a group without this rank")
    return group


def group_backend(group) -> str:
    """The communication backend's name ("gloo", "nccl", or a combined "cpu:gloo,cuda:nccl")."""
    return str(dist.get_backend(group)).lower()


def device_reasons(group, device: torch.device) -> list[str]:
    """Why the group's backend cannot move tensors of `device` point to point (empty: it can)."""
    name = group_backend(group)
    if ":" in name:  # a combined backend routes each device type to its own
        kinds = dict(part.split(":", 1) for part in name.split(","))
        if device.type not in kinds:
            return [f"the group's backend {name!r} serves no {device.type} tensors"]
        name = kinds[device.type]
    if name == "nccl" and device.type != "cuda":
        return [f"an NCCL group moves CUDA tensors only; the inputs are on {device}"]
    if name == "gloo" and device.type != "cpu":
        return [f"a gloo group sends and receives CPU tensors only; the inputs are on {device} (use NCCL)"]
    return []


def metadata_device(group) -> torch.device:
    """Where the agreement step's small tensor lives: the current CUDA device for NCCL, else CPU."""
    name = group_backend(group)
    if name == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True)
class Ring:
    group: object
    rank: int  # within the group
    size: int
    next_peer: int  # global ranks, as point-to-point operations take them
    prev_peer: int

    @classmethod
    def of(cls, group) -> Ring:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        return cls(group, rank, size, dist.get_global_rank(group, (rank + 1) % size),
                   dist.get_global_rank(group, (rank - 1) % size))

    def owner(self, step: int) -> int:
        """The rank whose shard this rank holds at ring step `step`."""
        return (self.rank - step) % self.size

    def pass_on(self, send: torch.Tensor, receive: torch.Tensor, tag: int) -> list:
        """Post: send `send` to the next rank, receive `receive` from the previous one; the caller
        waits on the returned works (`wait`) before reading `receive` or changing `send`."""
        ops = [
            dist.P2POp(dist.isend, send, self.next_peer, self.group, tag),
            dist.P2POp(dist.irecv, receive, self.prev_peer, self.group, tag),
        ]
        return dist.batch_isend_irecv(ops)

    def all_gather_rows(self, row: list[int], device: torch.device) -> list[list[int]]:
        """Every rank's `row` of int64 values (one small collective and one host read)."""
        mine = torch.tensor(row, dtype=torch.int64, device=device)
        rows = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(rows, mine, group=self.group)
        return torch.stack(rows).tolist()


def wait(works: list | None) -> None:
    for work in works or ():
        work.wait()


def float_bits(value: float) -> int:
    """A float64 as an int64 with the same bits: exact comparison across ranks."""
    return struct.unpack("<q", struct.pack("<d", value))[0]
