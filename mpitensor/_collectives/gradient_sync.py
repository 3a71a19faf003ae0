"""`GradientSync`: average gradients across ranks while backward still runs (DDP's way).

Parameters are registered once, by name, with their shapes and dtypes. They are packed
into buckets in reverse registration order, the order backward produces gradients. Each
gradient is copied into its bucket as it is submitted, and a bucket's all-reduce starts
the moment its last gradient arrives, so communication overlaps the rest of backward.
`wait()` returns every reduced gradient. This is Burn's ``register_sync_parameters`` /
``submit_gradient_sync`` / ``sync_collective``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .._core.config import ReduceOperation, parse_op
from .._core.dtypes import reduce_plan, transfer_dtype
from .._core.interop import describe, numpy_dtype, type_name
from .._core.tensor import Tensor, wrap_array
from .._runtime.context import DevicesArg
from .._transport.buckets import shared_bucket
from .common import CollectiveTensor, context_for, take_input, timeout_arg
from .fused import plan_buckets, start_buckets, structure_hash
from .gradient_gpu import GpuBuckets
from .options import make_record, scale_factors, scale_options

__all__ = ["GradientSync"]


def _spec(name: str, value: Any) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype of a registered parameter: a (shape, dtype) pair or a tensor of any library.

    Raises:
        TypeError: neither (named by its type: a parameter's values are not printed).
    """
    if isinstance(value, (tuple, list)):
        try:
            shape, dtype = value
            shape = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
            return shape, numpy_dtype(dtype)
        except (TypeError, ValueError):
            pass
    else:
        described = describe(value)
        if described is not None:
            return described
    raise TypeError(
        f"parameter {name!r}: expected (shape, dtype) or a tensor or array (mpitensor, NumPy, CuPy, "
        f"torch, JAX), got {type_name(value)}"
    )


class GradientSync:
    """Reduce gradients in buckets, each started as soon as its gradients are all in.

    Args:
        params: parameter name to ``(shape, dtype)`` (or a tensor/array of that shape and
            dtype, of any library: ``dict(model.named_parameters())`` works), in
            registration (forward) order. Every rank registers the same.
        op: the reduction (`ReduceOperation.MEAN` averages, as data-parallel training wants).
        bucket_bytes: the bucket size; None for the context's ``config.bucket_bytes``.
        devices: the group; None for every rank of the context.
        prescale_factor: multiplies each gradient as it is copied into its bucket
            (the submitted gradient is not changed). Integer gradients take integers only.
        postscale_factor: multiplies each reduced gradient (after MEAN's division).

    Raises:
        TypeError: a spec is not a (shape, dtype) pair, a dtype cannot be reduced, or a
            factor does not suit a parameter's dtype.
        ValueError: no parameters, or a name that is not a string.
        NoContextError: no context is open.
    """

    def __init__(
        self,
        params: Mapping[str, Any],
        *,
        op: ReduceOperation | str = ReduceOperation.MEAN,
        bucket_bytes: int | None = None,
        devices: DevicesArg = None,
        prescale_factor: float | None = None,
        postscale_factor: float | None = None,
    ) -> None:
        self._ctx = context_for("GradientSync")
        self._op = parse_op(op)
        if not params:
            raise ValueError("GradientSync needs at least one parameter")
        specs = {}
        for name, value in params.items():
            if not isinstance(name, str):
                raise ValueError(f"parameter names must be strings, got {name!r}")
            shape, dtype = _spec(name, value)
            specs[name] = (shape, transfer_dtype(dtype))
        self._specs = specs
        self._factors = {
            name: scale_factors(prescale_factor, postscale_factor, dtype, f"GradientSync parameter {name!r}")
            for name, (_, dtype) in specs.items()
        }
        self._options = scale_options(*next(iter(self._factors.values())))
        self._group = self._ctx.group(devices, "gradient sync")
        self._bucket_bytes = bucket_bytes or self._ctx.config.bucket_bytes
        order = list(reversed(specs))  # backward produces the last layer's gradients first
        plans = [reduce_plan(self._op, specs[name][1]) for name in order]
        sizes = [int(np.prod(specs[name][0], dtype=np.int64)) for name in order]
        self._buckets = plan_buckets(sizes, plans, self._bucket_bytes)
        self._where: dict[str, tuple[int, int, int]] = {}
        for index, bucket in enumerate(self._buckets):
            for member, offset in zip(bucket.members, bucket.offsets):
                self._where[order[member]] = (index, offset, sizes[member])
        self._names = [[order[m] for m in bucket.members] for bucket in self._buckets]
        self._hashes = [
            structure_hash(names, [np.empty(specs[n][0], specs[n][1]) for n in names]) for names in self._names
        ]
        self._reset()

    def _reset(self) -> None:
        self._sends = [self._ctx.pool.empty((b.elements,), b.plan.work_dtype) for b in self._buckets]
        self._missing = [len(b.members) for b in self._buckets]
        self._submitted: set[str] = set()
        self._backs: dict[str, Any] = {}  # name -> converter back, for gradients of other libraries
        self._handles: list[CollectiveTensor | None] = [None] * len(self._buckets)
        self._gpu: GpuBuckets | None = None  # this step's GPU gradients, if any

    @property
    def bucket_names(self) -> list[list[str]]:
        """The parameter names in each bucket, in the order buckets start."""
        return [list(names) for names in self._names]

    @property
    def started(self) -> int:
        """How many buckets of this step have started their all-reduce."""
        return sum(handle is not None for handle in self._handles)

    def submit(self, name: str, grad: Any) -> None:
        """Hand over one parameter's gradient; starts its bucket's all-reduce once full.

        The gradient is copied, so its buffer may be reused at once (a GPU gradient: by
        work queued after this call on the stream current now). A GPU gradient is copied to
        the host asynchronously: this call does not wait for the GPU.

        Args:
            name: the parameter's registered name.
            grad: its gradient (a Tensor or an array of any library, of the registered shape
                and dtype); `wait()` gives it back in the same library.

        Raises:
            ValueError: unknown name, the same name twice in one step, or a wrong shape.
            TypeError: a wrong dtype, or not a tensor.
        """
        if name not in self._where:
            known = ", ".join(repr(n) for n in self._specs)
            raise ValueError(f"unknown parameter {name!r}: the registered parameters are {known}")
        if name in self._submitted:
            raise ValueError(
                f"the gradient of {name!r} was already submitted in this step; call wait() to finish the step"
            )
        source = take_input(grad, self._ctx, f"GradientSync.submit({name!r})", "grad")
        shape, dtype = self._specs[name]
        if tuple(source.array.shape) != shape:
            raise ValueError(f"the gradient of {name!r} has shape {tuple(source.array.shape)}, expected {shape}")
        if source.buffer.dtype != dtype:
            raise TypeError(f"the gradient of {name!r} has dtype {source.buffer.dtype}, expected {dtype}")
        index, offset, size = self._where[name]
        pre = self._factors[name][0]
        if source.on_gpu:
            # Copied asynchronously into a pinned bucket; its all-reduce waits for the copy.
            if self._gpu is None:
                self._gpu = GpuBuckets()
            self._sends[index] = self._gpu.send(index, self._sends[index])
            self._gpu.stage(self._ctx, name, index, source, self._sends[index][offset : offset + size], pre)
        else:
            target = self._sends[index][offset : offset + size]
            np.copyto(target, source.buffer.reshape(-1), casting="unsafe")
            if pre is not None:  # scaled in the bucket, never in the caller's gradient
                np.multiply(target, pre, out=target, casting="unsafe")
        self._submitted.add(name)
        if source.back is not None:
            self._backs[name] = source.back
        self._missing[index] -= 1
        if self._missing[index] == 0:
            self._start(index)

    def _start(self, index: int) -> None:
        bucket = self._buckets[index]
        ready = self._gpu.ready(index) if self._gpu is not None else None
        # A host bucket is filled: it may take shared memory, as a fused call's would.
        call = shared_bucket(self._ctx, self._group, self._sends[index], bucket.plan) if ready is None else None
        out = self._ctx.pool.empty((bucket.elements,), bucket.plan.work_dtype) if call is None else call.out
        device = self._ctx.cpu_device
        views = {}
        rounding = []
        for name, offset in zip(self._names[index], bucket.offsets):
            shape, dtype = self._specs[name]
            size = int(np.prod(shape, dtype=np.int64))
            view = out[offset : offset + size].reshape(shape)
            plan = reduce_plan(self._op, dtype)
            if plan.rounds_back:  # half precision, reduced in float32
                final = self._ctx.pool.empty(shape, plan.out_dtype)
                rounding.append((view, final))
                view = final
            views[name] = wrap_array(view, device)
        record = make_record(self._options, "gradient sync", self._op, None, (index, bucket.elements), -1,
                             self._group.members, extra=self._hashes[index])
        self._handles[index] = start_buckets(
            self._ctx, self._group, [bucket], [self._sends[index]], [out], views, record, out.nbytes, rounding,
            ready=ready, shared=[call],
        )

    def wait(self, timeout: float | None = None) -> dict[str, Tensor]:
        """Finish the step: wait for every bucket and return every reduced gradient.

        Args:
            timeout: seconds to wait at most for each bucket; None for the context's.

        Returns:
            Parameter name to reduced gradient, in registration order, on the device its
            gradient came from (a GPU gradient's result is on its GPU, ordered on the stream
            of its `submit`), and a torch tensor for a gradient submitted as one, and so on.

        Raises:
            RuntimeError: some gradients were not submitted in this step.
            CollectiveTimeoutError, CollectiveMismatchError: as for any collective.
        """
        missing = [name for name in self._specs if name not in self._submitted]
        if missing:
            raise RuntimeError(
                f"wait() before every gradient was submitted in this step: missing {missing}"
            )
        limit = timeout_arg(timeout, self._ctx)
        reduced: dict[str, Tensor] = {}
        backs, gpu = self._backs, self._gpu
        try:
            for handle in self._handles:
                assert handle is not None
                reduced.update(handle.resolve(limit))
        finally:
            self._reset()
        for name, tensor in reduced.items():
            post = self._factors[name][1]
            if post is not None:
                np.multiply(tensor.array, post, out=tensor.array, casting="unsafe")
        if gpu is not None:  # every bucket is complete: results go to the GPUs they came from
            reduced = {name: gpu.upload(name, t) if gpu.on_gpu(name) else t for name, t in reduced.items()}
            gpu.release()
        if backs:
            return {name: backs[name](reduced[name]) if name in backs else reduced[name] for name in self._specs}
        return {name: reduced[name] for name in self._specs}
