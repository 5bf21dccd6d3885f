"""Collectives as probes issue them: tracked (op, group, seq, call site) and open to faults.

Probes call `ctx.comm.all_reduce(...)` instead of `torch.distributed.all_reduce(...)` so
that a hang report can say which collective each rank is in, and so that tests can make
one rank skip, corrupt or add a collective (distdiag.runtime.faults).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from distdiag.hang.groupid import GroupId
from distdiag.hang.recorder import group_label
from distdiag.runtime.faults import FaultPlan
from distdiag.runtime.tracker import Tracker

__all__ = ["Comm", "group_name", "ALL_GATHER_SINGLE", "REDUCE_SCATTER_SINGLE"]

# torch 2.13 renamed the *_into_tensor / *_tensor collectives to *_single and deprecates
# the old names; older torch has only the old ones. Use whichever this torch has.
ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


_OP_NAMES: dict[dist.ReduceOp | dist.ReduceOp.RedOpType, str] = {}


def _op_name(op: dist.ReduceOp | dist.ReduceOp.RedOpType) -> str:
    name = _OP_NAMES.get(op)
    if name is None:
        name = _OP_NAMES[op] = str(op).rsplit(".", 1)[-1].lower()
    return name


def group_name(group: dist.ProcessGroup | None) -> str:
    """The group's label, as the watchdog's wrappers and the recorder's positions give it
    (distdiag.hang.recorder.group_label: its members, and what tells a twin apart)."""
    if group is None:
        return GroupId(world=True).label
    try:
        return group_label(str(group.group_name))
    except Exception:  # noqa: BLE001 - a name is only a label
        return str(group)


class Comm:
    """Tracked wrappers of the torch.distributed collectives distdiag's probes use."""

    def __init__(self, tracker: Tracker, faults: FaultPlan | None = None) -> None:
        self.tracker = tracker
        self.faults = faults or FaultPlan()

    def _run(self, op: str, tensor: torch.Tensor | list[torch.Tensor] | None, group: dist.ProcessGroup | None, call: Callable[[], object],
             out: torch.Tensor | list[torch.Tensor] | None = None, detail: str = "") -> object:
        point = self.tracker.probe_name
        index = self.tracker.collectives_in_probe + 1
        if self.faults:
            self.faults.at(point, index - 1)
            action = self.faults.collective_fault(point, index)
        else:
            action = None
        if action == "skip":
            return None
        if action == "extra" and isinstance(tensor, torch.Tensor):
            with self.tracker.collective("all_reduce", tensor, group_name(group)):
                dist.all_reduce(tensor.clone(), group=group)  # the injected extra call
        record = self.tracker.begin(op, tensor, group_name(group), detail)
        try:
            result = call()
        finally:
            self.tracker.end(record)
        if action == "corrupt":
            target = out if out is not None else tensor
            if isinstance(target, list):
                target = target[-1]
            assert target is not None, f"fault 'corrupt' on {op}, which has no tensor"
            target.add_(1)
        return result

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp | dist.ReduceOp.RedOpType | None = None, group: dist.ProcessGroup | None = None) -> None:
        op = dist.ReduceOp.SUM if op is None else op
        self._run(
            "all_reduce", tensor, group, lambda: dist.all_reduce(tensor, op=op, group=group),
            detail=_op_name(op),
        )

    def broadcast(self, tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> None:
        self._run(
            "broadcast", tensor, group, lambda: dist.broadcast(tensor, src=src, group=group), detail=f"src={src}"
        )

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
        self._run(
            "all_gather", tensor, group, lambda: dist.all_gather(outputs, tensor, group=group), outputs
        )

    def all_gather_into_tensor(self, output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
        self._run(
            "all_gather_into_tensor", tensor, group,
            lambda: ALL_GATHER_SINGLE(output, tensor, group=group), output,
        )

    def reduce_scatter_tensor(self, output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
        self._run(
            "reduce_scatter_tensor", tensor, group,
            lambda: REDUCE_SCATTER_SINGLE(output, tensor, group=group), output,
        )

    def all_to_all_single(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self._run(
            "all_to_all_single", tensor, group,
            lambda: dist.all_to_all_single(
                output, tensor, output_split_sizes, input_split_sizes, group=group
            ),
            output,
        )

    def send_recv(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> None:
        """One send and one receive posted together (a ring step cannot deadlock)."""

        def call() -> None:
            ops = [dist.P2POp(dist.isend, send, dst, group), dist.P2POp(dist.irecv, recv, src, group)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        self._run("send_recv", send, group, call, recv, detail=f"to={dst},from={src}")

    def barrier(self, group: dist.ProcessGroup | None = None) -> None:
        self._run("barrier", None, group, lambda: dist.barrier(group=group))
