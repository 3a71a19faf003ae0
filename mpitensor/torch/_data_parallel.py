"""`DataParallel`: torch's ``DistributedDataParallel`` on mpitensor's collectives."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

import mpitensor as mt

from ._broadcast import broadcast_tensors
from ._ddp_options import resolve
from ._join import Joiner
from ._reducer import Reducer

__all__ = ["DataParallel"]


class DataParallel(torch.nn.Module):
    """Data-parallel training of `module` over every rank of the open context (DDP's behaviour).

    At construction rank 0's parameters and buffers are copied to every rank. During each
    backward the gradients are averaged across ranks in buckets, each started as soon as
    its gradients are accumulated, so communication overlaps the rest of backward; when
    ``loss.backward()`` returns, every ``param.grad`` holds the average. ``param.grad`` is
    a view of the bucket's buffer (DDP's ``gradient_as_bucket_view``).

    Args:
        module: the model (its parameters on the CPU); every rank builds the same one.
        bucket_bytes: the size of a gradient bucket; None for the context's
            ``config.bucket_bytes`` (25 MiB). The first bucket holds at most 1 MiB, as DDP's.
        **ddp_options: DDP's keyword arguments, with DDP's meaning where they have one
            here: ``bucket_cap_mb`` (the bucket size in MiB, instead of `bucket_bytes`),
            ``init_sync`` (False: no copy from rank 0 at construction),
            ``forward_sync_buffers`` / ``broadcast_buffers`` (rank 0's buffers before each
            forward; ``broadcast_buffers=False`` also skips them at construction, as in DDP),
            ``device_ids`` / ``output_device`` (None for CPU modules), ``dim`` (no effect on
            CPU). ``find_unused_parameters``, ``static_graph``, ``gradient_as_bucket_view``,
            ``check_reduction``, ``skip_all_reduce_unused_params`` and ``batched_grad_copy``
            are accepted hints that DataParallel does not need (see docs/torch.md).
            ``process_group``, ``device_mesh``, ``mixed_precision``, ``bucket_cap_mb_list``,
            ``delay_all_reduce_named_params`` and ``param_to_hook_all_reduce`` must be None.

    Raises:
        NoContextError: no context is open.
        TypeError: a parameter or buffer is not on the CPU, a sparse parameter, or a DDP
            argument DataParallel does not support (the message says what to use instead).
        ValueError: a device for a CPU module, or a bucket size that is not positive.
        CollectiveMismatchError: the ranks' modules differ in the size of their state.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        bucket_bytes: int | None = None,
        **ddp_options: Any,
    ) -> None:
        super().__init__()
        options = resolve(bucket_bytes, ddp_options)  # before any communication
        _validate(module, options.bucket_bytes)
        ctx = mt.current_context()
        self.module = module
        self.broadcast_buffers = options.forward_buffers
        named = [(name, param) for name, param in module.named_parameters() if param.requires_grad]
        if options.init_sync:
            broadcast_tensors([*module.parameters(), *(module.buffers() if options.init_buffers else ())], root=0)
        self._ranks = ctx.size
        self._joiner: Joiner | None = None  # inside join()
        self._reducer = (
            Reducer([name for name, _ in named], [param for _, param in named],
                    options.bucket_bytes or ctx.config.bucket_bytes)
            if named else None
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Broadcast rank 0's buffers (if asked), then run the wrapped module.

        Inside `join` the buffers come from the largest rank still training, as DDP's.
        """
        self._sync_buffers(0 if self._joiner is None else self._joiner.notify())
        output = self.module(*args, **kwargs)
        if self._reducer is not None and torch.is_grad_enabled():
            self._reducer.watch(output)
        return output

    def _sync_buffers(self, root: int) -> None:
        if self.broadcast_buffers and self._ranks > 1:
            # Looked up again each time: a buffer may have been reassigned (module.buf = t).
            buffers = [buffer for _, buffer in self.module.named_buffers()]
            if buffers:
                broadcast_tensors(buffers, root=root, keep_versions=True)

    @contextlib.contextmanager
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Iterator[None]:
        """Train on uneven inputs: ranks whose inputs run out make their peers' calls (DDP's ``join``).

        Each step inside the block must be one forward and one backward. At the block's end
        a rank waits, taking part in its peers' steps (contributing zero gradients), until
        every rank has joined; then every rank gets the model of the last rank to join.

        Args:
            divide_by_initial_world_size: True divides the gradients' sum by every rank,
                joined ones included (DDP's default); False by the ranks still training.
            enable: False makes the block do nothing (every rank must have as many steps).
            throw_on_early_termination: raise a RuntimeError on every rank as soon as one
                runs out of inputs, instead of shadowing.

        Raises:
            RuntimeError: a rank ran out with `throw_on_early_termination`, or the block is
                already open.
        """
        if not enable:
            yield
            return
        if self._joiner is not None:
            raise RuntimeError("DataParallel.join: a join() block of this model is already open")
        buffers = list(self.module.buffers()) if self.broadcast_buffers else []
        self._joiner = Joiner(self._reducer, self._sync_buffers, [*self.module.parameters(), *buffers],
                              divide_by_initial_world_size, throw_on_early_termination)
        try:
            yield
            self._joiner.shadow()
        finally:
            self._joiner = None
            if self._reducer is not None:
                self._reducer.divide_by(self._ranks)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Within this block backward only accumulates gradients locally.

        The first backward after the block averages what was accumulated, as DDP's
        ``no_sync`` does (gradient accumulation over several micro-batches).
        """
        reducer = self._reducer
        if reducer is None:
            yield
            return
        before, reducer.sync = reducer.sync, False
        try:
            yield
        finally:
            reducer.sync = before

    @property
    def bucket_names(self) -> list[list[str]]:
        """The parameter names in each gradient bucket, in the order the buckets start."""
        if self._reducer is None:
            return []
        return [[self._reducer.names[index] for index in bucket.members] for bucket in self._reducer.buckets]


def _validate(module: Any, bucket_bytes: Any) -> None:
    """Raise for a module DataParallel cannot train, or a bad bucket size.

    Raises:
        TypeError: not a Module, a tensor not on the CPU or not dense, sparse gradients,
            or a bucket size that is not an int.
        ValueError: a bucket size that is not positive.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"DataParallel wraps a torch.nn.Module, got {type(module).__name__}")
    if bucket_bytes is not None:
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int):
            raise TypeError(f"DataParallel: bucket_bytes must be an int or None, got {type(bucket_bytes).__name__}")
        if bucket_bytes <= 0:
            raise ValueError(f"DataParallel: bucket_bytes must be positive, got {bucket_bytes}")
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if tensor.device.type != "cpu":
            raise TypeError(f"DataParallel: {name!r} is on {tensor.device}; DataParallel supports CPU modules")
        if tensor.layout is not torch.strided:
            raise TypeError(f"DataParallel: {name!r} is a {tensor.layout} tensor; only dense ones are supported")
    _check_sparse(module)


def _check_sparse(module: torch.nn.Module) -> None:
    """Raise TypeError for an embedding with sparse gradients (only dense ones are averaged)."""
    for prefix, sub in module.named_modules():
        if isinstance(sub, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and sub.sparse:
            name = f"{prefix}.weight" if prefix else "weight"
            raise TypeError(
                f"DataParallel: {name!r} needs sparse gradients ({type(sub).__name__}(sparse=True)); "
                "DataParallel averages dense gradients only: build it with sparse=False"
            )
