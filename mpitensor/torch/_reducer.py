"""The gradient reducer behind `DataParallel`: buckets, hooks and the end of backward.

Parameters are packed into buckets in reverse registration order (the order backward
produces their gradients), one dtype per bucket, as DDP does. Each parameter's gradient
lives in its bucket: ``param.grad`` is a view of the bucket's flat buffer, so autograd
accumulates into the bucket and a ready bucket is all-reduced without packing. A bucket
starts the moment its last gradient is accumulated, in bucket order on every rank (a
bucket that is ready early waits for the ones before it, so the ranks' MPI calls match).
At the end of backward the reducer waits for the buckets and copies the averages back
into the same buffers. A parameter that got no gradient on a rank contributes zeros there
(Horovod's rule), so ranks that differ in the parameters they use still make the same calls.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_leaves

import mpitensor as mt

from ._arrays import flat_buffer

__all__ = ["Reducer"]

# DDP's size of the first bucket: small, so that communication starts early in backward.
FIRST_BUCKET_BYTES = 1 << 20


@dataclass
class Bucket:
    """Parameters (by index) whose gradients travel together, and their flat buffer."""

    dtype: torch.dtype
    members: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    elements: int = 0
    flat: Any = None  # torch.Tensor over `array`'s memory
    array: Any = None  # np.ndarray: what the all-reduce reads
    pending: int = 0
    prescale: bool = False  # float32/float64: gradients are divided as they enter the bucket
    handle: Any = None  # the CollectiveTensor of this step's all-reduce


def plan(params: Sequence[torch.Tensor], bucket_bytes: int, first_bytes: int) -> list[Bucket]:
    """Pack the parameters, last first, into buckets of one dtype and at most `bucket_bytes`.

    The first bucket holds at most `first_bytes`; a parameter larger than a bucket gets one
    of its own.
    """
    buckets: list[Bucket] = []
    open_by_dtype: dict[torch.dtype, Bucket] = {}
    for index in reversed(range(len(params))):
        param = params[index]
        limit = first_bytes if len(buckets) <= 1 else bucket_bytes
        bucket = open_by_dtype.get(param.dtype)
        size = param.numel()
        if bucket is None or (bucket.members and (bucket.elements + size) * param.element_size() > limit):
            bucket = open_by_dtype[param.dtype] = Bucket(param.dtype)
            buckets.append(bucket)
        bucket.members.append(index)
        bucket.offsets.append(bucket.elements)
        bucket.elements += size
    return buckets


class Reducer:
    """Averages the gradients of `params` across every rank during each synced backward.

    Args:
        names: the parameters' names, for messages.
        params: the parameters that require grad, in registration order.
        bucket_bytes: the bucket size in bytes.
    """

    def __init__(self, names: list[str], params: list[torch.Tensor], bucket_bytes: int) -> None:
        ranks = mt.current_context().size
        self.ranks = ranks
        self.scale = 1.0 / ranks  # what a prescaled gradient is multiplied by
        self.mean_factor = 1.0  # what a MEAN bucket's average is multiplied by (join: ranks still training)
        self.names = names
        self.params = params
        self.sync = True
        self.buckets = plan(params, bucket_bytes, min(FIRST_BUCKET_BYTES, bucket_bytes))
        self.views: list[torch.Tensor] = [None] * len(params)  # type: ignore[list-item]
        self.where: list[int] = [0] * len(params)  # each parameter's bucket
        for number, bucket in enumerate(self.buckets):
            # The last bucket carries one more element, the "some rank had a parameter
            # without gradient" flag: it travels in an all-reduce made anyway.
            flag = 1 if number == len(self.buckets) - 1 else 0
            self._place(bucket, *flat_buffer(bucket.elements + flag, bucket.dtype))
            bucket.prescale = ranks > 1 and bucket.dtype in (torch.float32, torch.float64)
            for index in bucket.members:
                self.where[index] = number
        self.used = np.zeros(len(params), dtype=np.int32)  # a gradient since the last sync
        self.graphed: dict[int, torch.Tensor] = {}  # create_graph=True: the local gradients, graphs and all
        # The hooks reach the reducer through a weak reference, and are removed when it
        # goes: a module wrapped again after its first wrapper is dropped is reduced once.
        me = weakref.ref(self)
        hooks = [param.register_post_accumulate_grad_hook(_hook(me, index)) for index, param in enumerate(params)]
        weakref.finalize(self, _remove, hooks)
        self._reset()

    def _place(self, bucket: Bucket, flat: torch.Tensor, array: np.ndarray) -> None:
        """Make `array` (and `flat`, torch's view of it) the bucket's buffer and views."""
        bucket.flat, bucket.array = flat, array
        for index, offset in zip(bucket.members, bucket.offsets):
            param = self.params[index]
            self.views[index] = flat[offset : offset + param.numel()].view(param.shape)

    def _reset(self) -> None:
        self.ready = [False] * len(self.params)
        self.buckets[-1].flat[-1] = 0  # the flag: lowered for the next backward
        for bucket in self.buckets:
            bucket.pending = len(bucket.members)
            bucket.handle = None
        self.next = 0  # the next bucket to start
        self.graphed.clear()
        self.armed = False  # the end-of-backward callback is queued

    def watch(self, output: Any) -> None:
        """Arm the end-of-backward callback from the first node of `output`'s graph.

        torch runs a queued callback at the end of the backward that queued it. A hook on a
        parameter may run in the inner backward of reentrant checkpointing, which ends
        before the gradients outside the checkpoint are in; the output's node runs in the
        outermost backward, before any parameter's, so the callback waits for all of them.
        """
        me = weakref.ref(self)
        tensors = [output] if isinstance(output, torch.Tensor) else tree_leaves(output)
        for node in {t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None}:
            node.register_prehook(_prehook(me))

    def arm(self) -> None:
        """Queue `finish` at the end of the running backward, once per synced backward."""
        if self.sync and not self.armed:
            self.armed = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def on_gradient(self, index: int, param: torch.Tensor) -> None:
        """Autograd accumulated parameter `index`'s gradient (its post-accumulate hook)."""
        self.used[index] = 1
        if self.sync:
            self.mark_ready(index, param)

    def mark_ready(self, index: int, param: torch.Tensor) -> None:
        """Parameter `index`'s gradient is final for this backward: move it into its bucket.

        Raises:
            RuntimeError: the parameter's gradient was already accumulated in this backward.
        """
        self.arm()  # armed already where the output's node ran first, as it does from a loss
        if self.ready[index]:
            raise RuntimeError(
                f"DataParallel: the gradient of {self.names[index]!r} was produced twice in one backward "
                "(a parameter used in two reentrant checkpoints, or inside and outside one?); this is not supported: "
                "use torch.utils.checkpoint.checkpoint(..., use_reentrant=False) there"
            )
        bucket = self.buckets[self.where[index]]
        grad = param.grad
        if grad is not None and grad.requires_grad:  # backward(create_graph=True)
            self.graphed[index] = grad
            grad = grad.detach()
        self._enter(bucket, index, grad)
        param.grad = self.views[index]
        self.ready[index] = True
        bucket.pending -= 1
        if bucket.pending == 0:
            self._start_ready()

    def _enter(self, bucket: Bucket, index: int, grad: torch.Tensor | None) -> None:
        """Put a gradient into its place in the bucket (divided by the ranks where prescaled).

        A fresh gradient (after ``zero_grad(set_to_none=True)``) is copied in; one that is
        already the bucket's view is used where it is. Dividing here, in the pass that
        copies, saves MEAN's separate division of the result (as DDP divides first);
        half precision is averaged by mpitensor instead, in float32.
        """
        view = self.views[index]
        if grad is not None and grad.requires_grad:  # a graph-carrying gradient left by create_graph=True
            grad = grad.detach()
        if grad is None:
            view.zero_()
        elif not bucket.prescale:
            if grad is not view:
                view.copy_(grad)
        elif grad is view:
            view.mul_(self.scale)
        else:
            torch.mul(grad, self.scale, out=view)

    def _start_ready(self) -> None:
        """Start every bucket that is ready and whose predecessors have started."""
        while self.next < len(self.buckets) and self.buckets[self.next].pending == 0:
            bucket = self.buckets[self.next]
            op = mt.ReduceOperation.SUM if bucket.prescale else mt.ReduceOperation.MEAN
            bucket.handle = mt.all_reduce(bucket.array, op)
            self.next += 1

    def finish(self) -> None:
        """At the end of backward: complete every bucket and write the averages back.

        A parameter without gradient here contributes what it holds (zeros for none),
        and raises the flag in the last bucket. Only where some rank raised it does one
        more small all-reduce find the parameters no rank used, which keep their
        gradient as it was; so the ranks agree with no extra message in the common case.
        """
        try:
            if not any(self.ready):  # torch.autograd.grad (a gradient penalty's): no .grad, not a step
                return
            missing = [index for index, ready in enumerate(self.ready) if not ready]
            if missing:
                self.buckets[-1].flat[-1] = 1  # before the last bucket starts: it waits for these
                self._mark_unused(missing)
            averages = [bucket.handle.resolve().numpy() for bucket in self.buckets]
            everywhere = None
            if averages[-1][-1] != 0:
                everywhere = mt.all_reduce(self.used, mt.ReduceOperation.MAX).resolve().numpy()
            for bucket, average in zip(self.buckets, averages):
                self._write_back(bucket, average, everywhere)
            self._keep_graphs()
            self.used[:] = 0
        finally:
            self._reset()

    def _keep_graphs(self) -> None:
        """After backward(create_graph=True): the averages as gradients that keep their graphs.

        ``param.grad`` becomes ``local - local.detach() + average``: its value is exactly
        the average (the first difference is an exact zero), and differentiating it follows
        the local gradient's graph.
        A loss built from these gradients on every rank (the same value everywhere) thus
        gets, once its own backward averages over the ranks, the derivative of that loss of
        the averaged gradient.
        """
        with torch.enable_grad():
            for index, local in self.graphed.items():
                self.params[index].grad = local - local.detach() + self.views[index]
        self.graphed.clear()

    def _mark_unused(self, missing: list[int]) -> None:
        """Put the gradients of parameters unused in this backward into their buckets.

        What a parameter has accumulated (under ``no_sync``) goes in, zeros where it has
        no gradient; ``param.grad`` is left alone until the average is known.
        """
        for index in missing:
            bucket, param = self.buckets[self.where[index]], self.params[index]
            if bucket.prescale and param.grad is self.views[index]:
                param.grad = param.grad.clone()  # kept as it is if no rank used the parameter
            self._enter(bucket, index, param.grad)
            self.ready[index] = True
            bucket.pending -= 1
        self._start_ready()

    def _write_back(self, bucket: Bucket, average: np.ndarray, used: np.ndarray | None) -> None:
        """Copy a bucket's average into its buffer, skipping parameters no rank used.

        A parameter unused on every rank keeps its gradient as it was (None stays None);
        one unused here but used elsewhere gets the average as its gradient.
        """
        if used is None or all(used[index] for index in bucket.members):
            # Copied back rather than adopting the pooled result as the bucket: that measured
            # no faster, and this way each param.grad stays the same tensor across steps.
            np.copyto(bucket.array, average)
            targets = bucket.members
        else:
            targets = [index for index in bucket.members if used[index]]
            for index, offset in zip(bucket.members, bucket.offsets):
                if used[index]:
                    size = self.params[index].numel()
                    np.copyto(bucket.array[offset : offset + size], average[offset : offset + size])
        for index in targets:
            param = self.params[index]
            if param.grad is not self.views[index]:
                param.grad = self.views[index]
            if self.mean_factor != 1.0 and not bucket.prescale:
                self.views[index].mul_(self.mean_factor)

    def divide_by(self, contributors: int) -> None:
        """Average over `contributors` ranks from now on, the others sending zeros (join)."""
        self.scale = 1.0 / contributors
        self.mean_factor = self.ranks / contributors

    def shadow(self) -> None:
        """A joined rank's part in its peers' backward: zeros for every bucket, in their order.

        Then, where the flag came back raised, its part in the all-reduce of the used
        parameters (it used none). Its own gradients are left alone, as DDP's joined ranks'.
        """
        handles = [mt.all_reduce(np.zeros_like(bucket.array),
                                 mt.ReduceOperation.SUM if bucket.prescale else mt.ReduceOperation.MEAN)
                   for bucket in self.buckets]
        averages = [handle.resolve().numpy() for handle in handles]
        if averages[-1][-1] != 0:
            mt.all_reduce(np.zeros_like(self.used), mt.ReduceOperation.MAX).resolve()


def _hook(reducer: weakref.ref[Reducer], index: int) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        alive = reducer()
        if alive is not None:
            alive.on_gradient(index, param)

    return hook


def _prehook(reducer: weakref.ref[Reducer]) -> Callable[[Any], None]:
    def prehook(grad_outputs: Any) -> None:
        alive = reducer()
        if alive is not None:
            alive.arm()

    return prehook


def _remove(hooks: list[Any]) -> None:
    for handle in hooks:
        handle.remove()
