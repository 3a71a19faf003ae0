"""`ProcessGroupMpitensor`: torch.distributed's collectives on mpitensor's.

Each torch call starts mpitensor collectives (with their consistency check: ranks that
disagree get ``CollectiveMismatchError`` instead of a hang) and returns a `Work` whose
finish step writes the results into the caller's tensors. CPU inputs are read in place
(mpitensor takes a copy-on-write clone, so a tensor changed in flight costs a copy, never
a wrong result); results land in the caller's CPU tensors directly where mpitensor's path
allows it (``out=``), else they are copied in once. CUDA tensors go through mpitensor's
GPU paths (staged through the host, or CUDA-aware MPI).
"""

from __future__ import annotations

import math
import threading
import zlib
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import mpitensor as mt

from .. import integration
from ._arrays import host_view, numpy_dtype, torch_view
from ._completer import Completer
from ._hooks import HookCollectives
from ._monitored_barrier import Monitor, monitored_barrier
from ._p2p import discard, notice_error, send_notice, sendable
from ._reduce_ops import known_operation, reduce_operation
from ._sizes import agree_all_gather, agree_all_to_all, agree_gather, agree_scatter, refuse
from ._sparse import check_sparse, sparse_all_reduce
from ._thread_group import OWN_GROUP, ThreadGroup
from ._unseen import unseen_by_dynamo
from ._work import Work, finished_work, waited

__all__ = ["BACKEND_NAME", "ProcessGroupMpitensor"]

BACKEND_NAME = "mpitensor"
# Tags of monitored_barrier's tokens: a pair per group (from its name, the same on every
# rank), in the top quarter of mpitensor's tags (torch programs' own tags are small), so that
# a token one group's failed call leaves pending never pairs with another group's.
_TOKEN_TAGS = 12288
_TOKEN_GROUPS = (16384 - _TOKEN_TAGS) // 2


@unseen_by_dynamo
class ProcessGroupMpitensor(dist.ProcessGroup):
    """A torch process group whose collectives are mpitensor's (backend ``"mpitensor"``).

    Made by ``dist.init_process_group("mpitensor")`` and ``dist.new_group(ranks)``; not
    meant to be built directly. A group made with ``dist.new_group`` belongs to the thread
    that makes its first collective call on it: the context's thread keeps it an ordinary
    group; another thread's calls then run on a communicator of the group's own, each checked
    against its peers' (see `ThreadGroup`).

    Args:
        rank: this rank's number in the group.
        size: how many ranks the group has.
        ranks: the group's ranks in the mpitensor context (torch's global ranks), in group
            order; None for every rank.
        timeout: seconds a wait may take; None for the mpitensor context's timeout.
        by_first_thread: the group belongs to the thread that first calls a collective on it
            (a ``dist.new_group``'s; the default group is the context's thread's).
    """

    def __init__(self, rank: int, size: int, ranks: Sequence[int] | None, timeout: float | None,
                 by_first_thread: bool = False) -> None:
        super().__init__(rank, size)
        self._devices = None if ranks is None else list(ranks)
        self._timeout = timeout
        self._completer = Completer()
        self._on_shutdown: Callable[[], None] | None = None
        self._group_name = ""
        self._completed = finished_work(self._completer)
        self._group_desc = ""
        self._monitor = Monitor(self)  # what monitored_barrier calls leave posted
        self._sequence = 0  # collectives started on the group (torch's sequence number)
        # Made with the group, as every rank makes it: a communicator apart from the group's
        # collectives, for callbacks' collectives and for settling the group's end.
        self._side = integration.side_communicator(self._devices)
        # The callbacks' collectives have one of their own: a callback's call left unmatched
        # on one rank must never meet the group's end there.
        self._hooks = HookCollectives(integration.side_communicator(self._devices), timeout, self._completer.finished)
        if integration.thread_multiple():
            self._completer.serve = self._hooks.serve
        # Made now, while every member is here: the communicator of a helper thread that makes
        # the group's first call (see `ThreadGroup`).
        self._thread_group = (ThreadGroup(integration.side_communicator(self._devices), self._devices, timeout)
                              if by_first_thread else None)
        self._owned = self._thread_group  # None once the context's thread made the first call
        self._context = mt.current_context()  # whether a rank of it died decides how the group ends
        if self._devices is not None:
            # mpitensor makes a sub-group's communicator at its first collective, which waits
            # for every member: made now, while every member is here (torch's new_group), a
            # first call that one member skips (a failed monitored_barrier) cannot wait there.
            mt.barrier(self._devices)

    # -- identity ---------------------------------------------------------------------------

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """The backend's name, ``"mpitensor"``."""
        return BACKEND_NAME

    def setGroupName(self, name: str) -> None:  # noqa: N802 - torch's name
        """Keep the name torch gives the group (DeviceMesh and FSDP look it up)."""
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802 - torch's name
        """The name torch gave the group."""
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802 - torch's name
        """Keep torch's description of the group."""
        self._group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802 - torch's name
        """The description torch gave the group."""
        return self._group_desc

    def __repr__(self) -> str:
        return f"ProcessGroupMpitensor(rank={self.rank()}, size={self.size()}, ranks={self._devices})"

    def on_shutdown(self, action: Callable[[], None]) -> None:
        """Run `action` when torch destroys this group (the context opened for it closes)."""
        self._on_shutdown = action

    def shutdown(self) -> None:
        """Called by ``dist.destroy_process_group`` on every rank of the group: end it, once.

        Completes what failed ``monitored_barrier`` calls left posted on any rank (see
        `Monitor.settle`), frees the group's communicator and runs the shutdown action.
        """
        action, self._on_shutdown = self._on_shutdown, None
        self._completer.stop()
        if self._side is not None:
            # A program that closed its context first has nothing left to settle; nor has one whose
            # context lost a rank (fault tolerance: shrink_process_group ends the group at once).
            if _context_open() and not (self._context.fault_tolerant and self._context.broken):
                self._monitor.settle(self._side, self._timeout)
            self._hooks.free()
            if self._thread_group is not None:
                self._thread_group.free()
            self._side = None
        if action is not None:
            action()

    def abort(self) -> None:
        """End the whole job (MPI cannot end one group alone)."""
        mt.current_context().abort(1)

    def _get_sequence_number_for_group(self) -> int:
        """How many collectives the group has started (the same on every rank; torch's sequence number)."""
        return self._sequence

    def _set_sequence_number_for_group(self) -> None:
        """Start counting from zero (every rank of a new group already does)."""
        self._sequence = 0

    # -- helpers ----------------------------------------------------------------------------

    def _global(self, group_rank: int) -> int:
        return group_rank if self._devices is None else self._devices[group_rank]

    def _work(self, handles: Sequence[Any], finish: Callable[[list[Any]], None] | None, outputs: Any) -> Work:
        return Work(handles, finish, outputs, self._timeout, self._completer)

    def door(self, kind: str) -> Any:
        """The door of a call of `kind` on this group (every collective's, and torch's object collectives').

        An error inside it before the first collective takes the call's turn on the group;
        so does a mismatch of the callbacks' collectives that this rank learned of since its
        last call (see `HookCollectives.serve`). On a group a helper thread owns, the door of
        that thread's calls (`ThreadGroup.door`).

        Raises:
            ThreadMisuseError: (on entering it) a thread the group does not belong to.
        """
        if self._owned is not None and self._by_thread(kind):
            return self._owned.door(kind)
        return _Door(kind, self._devices, self._before_call)

    def _by_thread(self, kind: str) -> bool:
        """Whether a call of `kind` is the helper thread's that owns the group; its first call claims it.

        Where the context's thread makes the first call, the group is an ordinary one from then
        on: each call's one test of ``_owned`` finds None.
        """
        owned = self._owned
        if owned is None:  # the context's thread made the first call meanwhile
            return False
        if owned.claim(kind):
            return True
        self._owned = None
        return False

    def _on_thread(self, kind: str, *args: Any) -> Work:
        """Make torch's call `kind` on the helper thread that owns the group (`ThreadGroup.run`), complete on return."""
        return finished_work(self._completer, self._owned.run(kind, args))

    def _before_call(self) -> None:
        """What the program's thread does as it enters a call: seal the chains, raise what the callbacks left."""
        self._completer.seal()
        failure = self._hooks.take_failure()
        if failure is not None:
            raise failure

    def after(self, work: dist.Work, action: Callable[[], None], outputs: Any) -> Work:
        """A work that completes when `work` does, then runs `action` (writes results back)."""
        return Work([waited(work)], lambda _: action(), outputs, self._timeout, self._completer)

    # -- reductions -------------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        """``dist.all_reduce``: every tensor becomes the reduction over the group, in place.

        Called by a future's callback (a communication hook such as PowerSGD), it runs there
        on the callbacks' own communicator (see `HookCollectives`) and is complete on return.
        """
        self._sequence += 1
        if self._completer.on_thread():
            return finished_work(self._completer, self._hooks.all_reduce(tensors, opts, self._completer.chain))
        if self._owned is not None and self._by_thread("all_reduce"):
            return self._on_thread("all_reduce", tensors, opts)
        direct_ok = opts is not None and not opts.asyncOp and self._devices is None and len(tensors) == 1
        if direct_ok and self._hooks.clear():  # else the door raises what the callbacks left
            self._completer.seal()
            direct = _direct_call(tensors[0], opts)
            if direct is not None:
                # A CPU tensor reduced in its own memory through its NumPy view (torch's contract,
                # a tensor in a collective untouched until its work is waited for, is a held
                # call's): the kind's kept plan, no torch tensor made on the way. Nothing here
                # can fail before mpitensor's own call, so no door is needed.
                view, op = direct
                try:
                    mt.all_reduce(view, op, held=True).resolve(self._timeout)
                except mt.ThreadMisuseError as exc:  # costs nothing where nothing is raised
                    _name_the_remedy(exc)
                    raise
                return self._completed
        with self.door("all_reduce"):  # an error before the call takes its turn
            return self._all_reduce(tensors, opts)

    def _all_reduce(self, tensors: list[torch.Tensor], opts: Any) -> Work:
        op, factor = _operation(opts)
        devices = self._devices
        if any(tensor.layout is not torch.strided for tensor in tensors):
            sparse_all_reduce(check_sparse(tensors, op, factor), devices, self._timeout)
            return self._completed
        for tensor in tensors:
            _check_reduced(tensor, op, "all_reduce")
        waits = opts is not None and not opts.asyncOp
        views = [_held_view(tensor, op) if factor is None else None for tensor in tensors]
        handles = [_start_all_reduce(tensor, view, op, devices, factor) for tensor, view in zip(tensors, views)]
        finish = _reduced_into(tensors, views)
        if waits:
            # dist.all_reduce(async_op=False) waits at once: done here, the call costs no
            # Work of its own and no second crossing into Python for wait().
            results = [handle.resolve(self._timeout) for handle in handles]
            del handles  # with them the inputs' copy-on-write clones (see Work.complete)
            with torch.no_grad():  # a parameter is written as gloo writes it
                finish(results)
            return self._completed
        return self._work(handles, finish, tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        """``dist.all_reduce_coalesced`` and the coalescing manager: one fused all-reduce."""
        self._sequence += 1
        if self._owned is not None and self._by_thread("all_reduce_coalesced"):
            return self._on_thread("all_reduce_coalesced", tensors, opts)
        with self.door("all_reduce"):
            op, factor = _operation(opts)
            for tensor in tensors:
                _check_reduced(tensor, op, "all_reduce_coalesced")
            handle = mt.all_reduce(list(tensors), op, self._devices, prescale_factor=factor)
        return self._work([handle], lambda results: _copy_into(tensors)(results[0]), tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Work:
        """``dist.reduce``: the root's tensor becomes the reduction; others are unchanged."""
        self._sequence += 1
        if self._owned is not None and self._by_thread("reduce"):
            return self._on_thread("reduce", tensors, opts)
        with self.door("reduce"):
            op, factor = _operation(opts)
            root = self._global(opts.rootRank)
            tensor = _one(tensors, "reduce")
            _check_reduced(tensor, op, "reduce")
            handle = mt.reduce(tensor, op, root=root, devices=self._devices, prescale_factor=factor)
        mine = self._global(self.rank()) == root
        return self._work([handle], _copy_into([tensor]) if mine else None, tensors)

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: Any) -> Work:
        """``dist.reduce_scatter``: rank k gets the reduction of everyone's k-th tensor."""
        self._sequence += 1
        if self._owned is not None and self._by_thread("reduce_scatter"):
            return self._on_thread("reduce_scatter", output_tensors, input_tensors, opts)
        with self.door("reduce_scatter"):
            output = _one(output_tensors, "reduce_scatter")
            inputs = _only(input_tensors, "reduce_scatter")
            _check_count(inputs, self.size(), "reduce_scatter", "input_list", output.dtype)
            counts = [tensor.numel() for tensor in inputs]
            if output.numel() != counts[self.rank()]:
                refuse("reduce_scatter", self._devices,
                       f"reduce_scatter: rank {self._global(self.rank())}'s output has {output.numel()} elements, but "
                       f"the input_list's tensor {self.rank()} (its block) has {counts[self.rank()]}")
            flat = torch.cat([tensor.reshape(-1) for tensor in inputs])
            return self._reduce_scatter(output, flat, counts, opts)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Work:  # noqa: A002
        """``dist.reduce_scatter_tensor``: rank k gets block k of the reduced input."""
        self._sequence += 1
        if self._owned is not None and self._by_thread("reduce_scatter_tensor"):
            return self._on_thread("reduce_scatter_tensor", output, input, opts)
        with self.door("reduce_scatter"):
            self._check_scattered(output, input, "reduce_scatter_tensor")
            return self._reduce_scatter(output, input.reshape(-1), None, opts)

    def _check_scattered(self, output: torch.Tensor, input: torch.Tensor, what: str) -> None:  # noqa: A002
        """Check a ``reduce_scatter_tensor``'s pair: dense, and the input the group's size times the output."""
        _check_dense(input, what)
        _check_dense(output, what)
        _check_dtypes([input], output.dtype, what)
        if input.numel() != output.numel() * self.size():
            refuse("reduce_scatter", self._devices,
                   f"{what}: rank {self._global(self.rank())}'s input has {input.numel()} elements, but its "
                   f"output's {output.numel()} times the group's {self.size()} ranks is {output.numel() * self.size()}")

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any) -> Work:
        """Several ``reduce_scatter_tensor`` calls as one work (FSDP's coalesced form).

        Every pair is checked before the first starts, so that the call never fails halfway.
        """
        if self._owned is not None and self._by_thread("reduce_scatter_tensor_coalesced"):
            return self._on_thread("reduce_scatter_tensor_coalesced", outputs, inputs, opts)
        with self.door("reduce_scatter"):
            op = _operation(opts)[0]
            _check_pairs(outputs, inputs, "reduce_scatter_tensor_coalesced")
            for out, inp in zip(outputs, inputs):
                self._check_scattered(out, inp, "reduce_scatter_tensor_coalesced")
                _check_reduced(out, op, "reduce_scatter_tensor_coalesced")
        works = [self.reduce_scatter_single(out, inp, opts) for out, inp in zip(outputs, inputs)]
        return _joined(works, outputs, self)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _reduce_scatter(self, output: torch.Tensor, flat: torch.Tensor, counts: list[int] | None,
                        opts: Any) -> Work:
        op, factor = _operation(opts)
        _check_reduced(output, op, "reduce_scatter")
        if counts is not None and len(set(counts)) == 1:
            counts = None
        direct = None if _shares_memory(flat, output) else _direct_out(output, op)
        handle = mt.reduce_scatter(flat, op, devices=self._devices, counts=counts, prescale_factor=factor,
                                   out=None if direct is None else direct.reshape(-1))
        return self._work([handle], None if direct is not None else _copy_into([output]), [output])

    # -- data movement ----------------------------------------------------------------------

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Work:
        """``dist.broadcast``: every rank's tensor becomes the root's, in place."""
        self._sequence += 1
        if self._owned is not None and self._by_thread("broadcast"):
            return self._on_thread("broadcast", tensors, opts)
        with self.door("broadcast"):
            root = self._global(opts.rootRank)
            for tensor in tensors:  # all of them before the first starts: never a call failed halfway
                _check_dense(tensor, "broadcast")
            return self._broadcast(tensors, root)

    def _broadcast(self, tensors: list[torch.Tensor], root: int) -> Work:
        is_root = self._global(self.rank()) == root
        handles, copies = [], []
        for tensor in tensors:
            view = _host_out(tensor)
            if is_root:
                handles.append(mt.broadcast(tensor, root=root, devices=self._devices))
            elif view is not None:
                handles.append(mt.broadcast(None, root=root, devices=self._devices, out=view))
            else:
                handles.append(mt.broadcast(tensor, root=root, devices=self._devices))
                copies.append(len(handles) - 1)
        if not copies:
            return self._work(handles, None, tensors)
        copied = _copy_into([tensors[index] for index in copies])
        return self._work(handles, lambda results: copied([results[index] for index in copies]), tensors)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: Any = None) -> Work:
        """``dist.all_gather``: output k becomes rank k's input (sizes checked against every rank's outputs)."""
        self._sequence += 1
        if self._owned is not None and self._by_thread("all_gather"):
            return self._on_thread("all_gather", output_tensors, input_tensors, opts)
        with self.door("all_gather"):
            outputs = _only(output_tensors, "all_gather")
            tensor = _one(input_tensors, "all_gather")
            _check_count(outputs, self.size(), "all_gather", "tensor_list", tensor.dtype)
            agree_all_gather(self._devices, self._global(self.rank()), tensor.numel(),
                             [output.numel() for output in outputs], self._global)
            handle = mt.all_gather(tensor.reshape(-1), devices=self._devices)
        return self._work([handle], _split_into(outputs), outputs)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work:  # noqa: A002
        """``dist.all_gather_into_tensor``: the ranks' inputs concatenated into `output`.

        Each rank's input is gathered as one row, so that the check compares the inputs'
        sizes: ranks whose inputs differ get ``CollectiveMismatchError`` on every rank.
        """
        self._sequence += 1
        if self._owned is not None and self._by_thread("all_gather_into_tensor"):
            return self._on_thread("all_gather_into_tensor", output, input, opts)
        with self.door("all_gather"):
            self._check_gathered(output, input, "all_gather_into_tensor")
            view = None if _shares_memory(input, output) else _host_out(output)  # FSDP gathers in place
            out = None if view is None else view.reshape(self.size(), input.numel())
            handle = mt.all_gather(input.reshape(1, input.numel()), devices=self._devices, out=out)
        return self._work([handle], _copy_into([output]) if out is None else None, [output])

    def _check_gathered(self, output: torch.Tensor, input: torch.Tensor, what: str) -> None:  # noqa: A002
        """Check an ``all_gather_into_tensor``'s pair: dense, and the output the group's size times the input."""
        _check_dense(input, what)
        _check_dense(output, what)
        _check_dtypes([input], output.dtype, what)
        if output.numel() != input.numel() * self.size():
            per_rank = f"{output.numel() // self.size()} from each" if output.numel() % self.size() == 0 else (
                "no equal part from each")
            refuse("all_gather", self._devices,
                   f"{what}: rank {self._global(self.rank())}'s input has {input.numel()} elements, but its output "
                   f"of {output.numel()} takes {per_rank} of the group's {self.size()} ranks")

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> Work:
        """Several ``all_gather_into_tensor`` calls as one work (FSDP's coalesced form).

        Every pair is checked before the first starts, so that the call never fails halfway.
        """
        if self._owned is not None and self._by_thread("all_gather_into_tensor_coalesced"):
            return self._on_thread("all_gather_into_tensor_coalesced", outputs, inputs, opts)
        with self.door("all_gather"):
            _check_pairs(outputs, inputs, "all_gather_into_tensor_coalesced")
            for out, inp in zip(outputs, inputs):
                self._check_gathered(out, inp, "all_gather_into_tensor_coalesced")
        works = [self.all_gather_single(out, inp, opts) for out, inp in zip(outputs, inputs)]
        return _joined(works, outputs, self)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> Work:
        """``dist.all_to_all``: this rank's input j goes to rank j, as its output k from rank k.

        Each rank's output k is checked against what rank k sends it, before the data moves.
        """
        self._sequence += 1
        if self._owned is not None and self._by_thread("all_to_all"):
            return self._on_thread("all_to_all", output_tensors, input_tensors, opts)
        with self.door("all_to_all"):
            dtype = input_tensors[0].dtype if input_tensors else None
            _check_count(input_tensors, self.size(), "all_to_all", "input_tensor_list", dtype)
            _check_count(output_tensors, self.size(), "all_to_all", "output_tensor_list", dtype)
            splits = [tensor.numel() for tensor in input_tensors]
            agree_all_to_all("all_to_all", self._devices, self._global(self.rank()), splits,
                             [out.numel() for out in output_tensors], self._global, "output {k}")
            flat = torch.cat([tensor.reshape(-1) for tensor in input_tensors])
            # With splits on every rank whatever its sizes: whether all are equal is no rank's to know.
            handle = mt.all_to_all(flat, devices=self._devices, splits=splits)
        return self._work([handle], _split_into(output_tensors), output_tensors)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                          output_split_sizes: list[int], input_split_sizes: list[int], opts: Any = None) -> Work:
        """``dist.all_to_all_single``: rows of dim 0 to each rank, evenly or by the split sizes.

        With split sizes (every rank passes them, or none does), each rank's output split
        sizes are checked against what each rank sends it, before the data moves. Rows may
        be zero on any rank (an expert with no tokens).
        """
        self._sequence += 1
        if self._owned is not None and self._by_thread("all_to_all_single"):
            return self._on_thread("all_to_all_single", output, input, output_split_sizes, input_split_sizes, opts)
        with self.door("all_to_all"):
            _check_dense(input, "all_to_all_single")
            _check_dense(output, "all_to_all_single")
            _check_dtypes([input], output.dtype, "all_to_all_single")
            rows_in, width = _rows(input)
            rows_out, out_width = _rows(output)
            if out_width != width:
                raise ValueError(f"all_to_all_single: the input's rows have {width} elements, but the output's "
                                 f"{out_width}; both must have the same shape beyond dim 0")
            sent = _splits(input_split_sizes, rows_in, self.size(), "input")
            expected = _splits(output_split_sizes, rows_out, self.size(), "output")
            if input_split_sizes or output_split_sizes:
                agree_all_to_all("all_to_all_single", self._devices, self._global(self.rank()), sent, expected,
                                 self._global, "output_split_sizes[{k}]", "rows")
            elif rows_out != rows_in:
                refuse("all_to_all", self._devices,
                       f"all_to_all_single: rank {self._global(self.rank())}'s output has {rows_out} rows, but its "
                       f"input {rows_in}: without split sizes every rank sends and receives equal blocks")
            view = _host_out(output)
            out = None if view is None else view.reshape(rows_out, width)
            rows = input.reshape(rows_in, width)
            splits = sent if input_split_sizes or output_split_sizes else None
            handle = mt.all_to_all(rows, devices=self._devices, splits=splits, out=out)
        return self._work([handle], _copy_into([output]) if out is None else None, [output])

    alltoall_base = all_to_all_single

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any) -> Work:
        """``dist.gather``: the root's list gets every rank's input (sizes checked against the root's list)."""
        self._sequence += 1
        if self._owned is not None and self._by_thread("gather"):
            return self._on_thread("gather", output_tensors, input_tensors, opts)
        with self.door("gather"):
            root = self._global(opts.rootRank)
            me = self._global(self.rank())
            tensor = _one(input_tensors, "gather")
            outputs = None
            if me == root:
                outputs = _only(output_tensors, "gather")
                _check_count(outputs, self.size(), "gather", "gather_list", tensor.dtype)
            agree_gather(self._devices, me, root, tensor.numel(),
                         None if outputs is None else [output.numel() for output in outputs], self._global)
            handle = mt.gather(tensor.reshape(-1), root, devices=self._devices)
        if outputs is None:
            return self._work([handle], None, [])
        return self._work([handle], _split_into(outputs), outputs)

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any) -> Work:
        """``dist.scatter``: rank k's output becomes the root's k-th tensor (sizes checked against the outputs)."""
        self._sequence += 1
        if self._owned is not None and self._by_thread("scatter"):
            return self._on_thread("scatter", output_tensors, input_tensors, opts)
        with self.door("scatter"):
            root = self._global(opts.rootRank)
            me = self._global(self.rank())
            output = _one(output_tensors, "scatter")
            inputs = None
            if me == root:
                inputs = _only(input_tensors, "scatter")
                _check_count(inputs, self.size(), "scatter", "scatter_list", output.dtype)
            sizes = agree_scatter(self._devices, me, root, None if inputs is None else [t.numel() for t in inputs],
                                  output.numel())
            counts = None if len(set(sizes)) == 1 else sizes  # every rank has the root's sizes
            if inputs is not None:
                flat = torch.cat([tensor.reshape(-1) for tensor in inputs])
                handle = mt.scatter(flat, root, counts=counts, devices=self._devices)
            else:
                handle = mt.scatter(None, root, counts=counts, shape=(sum(sizes),), dtype=output.dtype,
                                    devices=self._devices)
        return self._work([handle], _copy_into([output]), [output])

    def barrier(self, opts: Any = None) -> Work:
        """``dist.barrier``: returns once every rank of the group has arrived.

        Raises:
            CollectiveTimeoutError: the group's timeout (or the call's) passed first.
        """
        self._sequence += 1
        if self._owned is not None and self._by_thread("barrier"):
            return self._on_thread("barrier", opts)
        timeout = _seconds(getattr(opts, "timeout", None)) or self._timeout
        if timeout is None:
            try:
                mt.barrier(self._devices)
            except mt.ThreadMisuseError as exc:
                _name_the_remedy(exc)
                raise
            return self._completed
        try:
            mt.barrier(self._devices, timeout=timeout)
        except mt.ThreadMisuseError as exc:
            _name_the_remedy(exc)
            raise
        except mt.CollectiveTimeoutError as exc:  # in gloo's words, which torch's tests match
            raise mt.CollectiveTimeoutError(f"barrier: Timed out waiting {int(timeout * 1000)} ms for every rank "
                                            f"of the group: {exc}") from exc
        return self._completed

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> Work:
        """``dist.all_gather_coalesced``: output list k gets rank k's inputs, all of them in one all-gather.

        The inputs travel as one row of every rank's elements, so ranks whose inputs differ
        in size raise ``CollectiveMismatchError`` on every rank (a check of the row's shape).
        """
        self._sequence += 1
        if self._owned is not None and self._by_thread("all_gather_coalesced"):
            return self._on_thread("all_gather_coalesced", output_lists, inputs, opts)
        with self.door("all_gather"):
            dtype = inputs[0].dtype if inputs else None
            for tensor in inputs:
                _check_dense(tensor, "all_gather_coalesced")
            _check_dtypes(inputs, dtype, "all_gather_coalesced")
            if len(output_lists) != self.size():
                raise ValueError(f"all_gather_coalesced: output_tensor_lists has {len(output_lists)} lists, but the "
                                 f"group has {self.size()} ranks")
            sizes = [tensor.numel() for tensor in inputs]
            for outputs in output_lists:
                _check_dtypes(outputs, dtype, "all_gather_coalesced", "output_tensor_lists")
                if [output.numel() for output in outputs] != sizes:
                    raise ValueError("all_gather_coalesced: each list of output_tensor_lists must hold tensors of "
                                     f"the inputs' sizes {sizes}, got {[output.numel() for output in outputs]}")
            flat = torch.cat([tensor.reshape(-1) for tensor in inputs]) if inputs else torch.empty(0)
            handle = mt.all_gather(flat.reshape(1, -1), devices=self._devices)
        outputs = [output for outputs in output_lists for output in outputs]
        return self._work([handle], _split_into(outputs), output_lists)

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """Gloo's ``monitored_barrier`` here: rank 0 names the ranks that did not arrive in time.

        Raises:
            RuntimeError: on rank 0, the ranks missing after `timeout` (all of them with
                `wait_all_ranks`, else the first); on a rank that arrived, rank 0 did not
                release it in time (gloo's words, see `monitored_barrier`).
        """
        if self._owned is not None and self._by_thread("monitored_barrier"):
            return self._on_thread("monitored_barrier", timeout, wait_all_ranks)
        monitored_barrier(self, self._monitor, timeout, wait_all_ranks, self._timeout)

    # -- point to point ---------------------------------------------------------------------

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> Work:  # noqa: N803 - torch's names
        """``dist.send``/``isend``: `tensors[0]` to group rank `dstRank` (flat; see `_p2p`).

        Raises:
            ValueError, TypeError: a tensor mpitensor cannot carry; the receiver gets an error too.
        """
        if self._owned is not None and self._by_thread("send"):
            raise self._owned.point_to_point("send")
        dest = self._global(dstRank)
        try:
            tensor = sendable(tensors, _check_dtype)
        except (ValueError, TypeError) as exc:
            send_notice(dest, tag, exc)
            raise
        return self._work([mt.send(tensor, dest, tag=tag)], None, tensors)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Work:
        """``dist.recv`` with no source: `tensors[0]` becomes the first message of `tag` from any rank.

        The work's ``_source_rank()`` is then the sender's group rank (torch asks it). On the
        default group (a sub-group's messages travel on the context's point-to-point
        communicator, where any rank would include non-members).

        Raises:
            NotImplementedError: on a sub-group; pass ``src=``.
            ValueError, TypeError: a tensor mpitensor cannot write.
        """
        if self._owned is not None and self._by_thread("recv"):
            raise self._owned.point_to_point("recv")
        if self._devices is not None:
            raise NotImplementedError("recv with no source: the mpitensor backend takes it on the default group "
                                      "only; pass src= (the sending rank) on a sub-group")
        tensor = _one(tensors, "recv", contiguous=False)
        view = _host_out(tensor) if tensor.is_contiguous() else None
        if view is not None:
            handle = mt.recv(None, mt.ANY_SOURCE, tag=tag, out=view.reshape(-1))
            return self._work([handle], _noticed(handle), tensors).keep_source()
        handle = mt.recv(None, mt.ANY_SOURCE, shape=(tensor.numel(),), dtype=tensor.dtype, tag=tag)
        return self._work([handle], _received_from_any(tensor, handle), tensors).keep_source()

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> Work:  # noqa: N803 - torch's names
        """``dist.recv``/``irecv``: `tensors[0]` becomes what group rank `srcRank` sent (its elements, in order).

        Raises:
            ValueError, TypeError: a tensor mpitensor cannot write (the message is taken anyway).
            CollectiveMismatchError: (at wait) the sender sent another number of elements or
                dtype, or its send failed on its rank.
        """
        if self._owned is not None and self._by_thread("recv"):
            raise self._owned.point_to_point("recv")
        source = self._global(srcRank)
        try:
            tensor = _one(tensors, "recv", contiguous=False)
        except (ValueError, TypeError):
            discard(source, tag)
            raise
        view = _host_out(tensor) if tensor.is_contiguous() else None
        if view is not None:
            handle = mt.recv(None, source, tag=tag, out=view.reshape(-1))
            return self._work([handle], None, tensors)
        handle = mt.recv(None, source, shape=(tensor.numel(),), dtype=tensor.dtype, tag=tag)
        return self._work([handle], _received_into(tensor, source), tensors)

    # -- monitored_barrier's messages -------------------------------------------------------

    def start_check(self) -> Any:
        """monitored_barrier's checked call (a one-byte scan, which no other call of the group makes).

        Every rank of a monitored_barrier makes it: a peer that makes another call there (a
        ``dist.barrier``) is a ``CollectiveMismatchError`` on every rank, not a wait.
        """
        return mt.scan(np.zeros(1, np.uint8), mt.ReduceOperation.SUM, devices=self._devices)

    def token(self, peer: int, release: bool) -> Any:
        """A monitored_barrier token to group rank `peer` (an arrival, or rank 0's release); the send's handle."""
        return mt.send(np.ones(1, np.uint8), self._global(peer), tag=self._token_tag(release))

    def receipt(self, peer: int, release: bool) -> Any:
        """The pending receipt of group rank `peer`'s next monitored_barrier token."""
        return mt.recv(None, self._global(peer), shape=(1,), dtype=np.uint8, tag=self._token_tag(release))

    def _token_tag(self, release: bool) -> int:
        return _TOKEN_TAGS + 2 * (zlib.crc32(self._group_name.encode()) % _TOKEN_GROUPS) + release


class _Door(mt.collective_call):
    """A call's door on a group of the context's thread: another thread is told how to get a group of its own."""

    __slots__ = ()

    def __enter__(self) -> _Door:
        try:
            return super().__enter__()
        except mt.ThreadMisuseError as exc:
            _name_the_remedy(exc)
            raise


def _name_the_remedy(error: mt.ThreadMisuseError) -> None:
    """Raise `error` with the remedy for a helper thread where it is one's call (not a signal handler's).

    Raises:
        ThreadMisuseError: `error`'s message and how a helper thread gets a group of its own.
    """
    if threading.get_ident() != mt.current_context().owner_thread:
        raise mt.ThreadMisuseError(f"{error}. {OWN_GROUP}") from error


# -- argument checks and result writers -----------------------------------------------------


def _operation(opts: Any) -> tuple[mt.ReduceOperation, float | None]:
    return reduce_operation(opts.reduceOp) if opts is not None else (mt.ReduceOperation.SUM, None)


# Why mpitensor cannot carry a dtype (None where it can), found once per dtype.
_DTYPE_PROBLEMS: dict[torch.dtype, str | None] = {}
_BITWISE = frozenset({mt.ReduceOperation.BAND, mt.ReduceOperation.BOR, mt.ReduceOperation.BXOR})


def _context_open() -> bool:
    try:
        mt.current_context()
    except (mt.NoContextError, mt.ForkedProcessError):
        return False
    return True


def _seconds(timeout: Any) -> float | None:
    """A torch option's timeout in seconds; None where it is unset (zero or negative)."""
    if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
        return timeout.total_seconds()
    return None


def _check_dtype(dtype: torch.dtype, what: str) -> None:
    """Refuse a dtype mpitensor cannot carry (no NumPy counterpart), before any call starts."""
    problem = _DTYPE_PROBLEMS.get(dtype, "")
    if problem == "":
        try:
            numpy_dtype(dtype)
            problem = None
        except TypeError as exc:
            problem = str(exc)
        _DTYPE_PROBLEMS[dtype] = problem
    if problem is not None:
        raise TypeError(f"{what}: {problem}")


def _check_dense(tensor: torch.Tensor, what: str, contiguous: bool = True) -> None:
    if tensor.layout is not torch.strided:
        raise ValueError(f"{what}: the mpitensor backend takes dense tensors, got one with layout {tensor.layout}")
    if contiguous and not tensor.is_contiguous():
        raise ValueError(f"{what}: Tensors must be contiguous (gloo's rule); pass tensor.contiguous()")
    _check_dtype(tensor.dtype, what)


def _check_reduced(tensor: torch.Tensor, op: mt.ReduceOperation, what: str) -> None:
    """`_check_dense`, and a bitwise operation only on integers and bools (mpitensor's rule, checked first)."""
    _check_dense(tensor, what)
    if op in _BITWISE and (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"{what}: {op.name} is a bitwise reduction, defined for integer and bool tensors only, "
                        f"got {tensor.dtype}")


def _one(tensors: Sequence[torch.Tensor], what: str, contiguous: bool = True) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(f"{what}: the mpitensor backend takes one tensor per call, got {len(tensors)}")
    _check_dense(tensors[0], what, contiguous)
    return tensors[0]


def _only(lists: Sequence[Any], what: str) -> Any:
    """The one list of torch's list of lists."""
    if len(lists) != 1:
        raise ValueError(f"{what}: the mpitensor backend takes one list of tensors per call, got {len(lists)}")
    return lists[0]


def _check_count(tensors: Sequence[torch.Tensor], size: int, what: str, argument: str,
                 dtype: torch.dtype | None = None) -> None:
    if len(tensors) != size:
        raise ValueError(f"{what}: {argument} has {len(tensors)} tensors, but the group has {size} ranks")
    for tensor in tensors:
        _check_dense(tensor, what)
        if tensor.device != tensors[0].device:  # torch.cat would refuse them after the sizes' exchange
            raise ValueError(f"{what}: {argument} has tensors on {tensors[0].device} and {tensor.device}; "
                             "pass tensors on one device")
    if dtype is not None:
        _check_dtypes(tensors, dtype, what, argument)


def _check_dtypes(tensors: Sequence[torch.Tensor], dtype: torch.dtype, what: str, argument: str = "the input") -> None:
    for tensor in tensors:
        if tensor.dtype != dtype:
            raise TypeError(f"{what}: {argument} has a tensor of {tensor.dtype}, but the call's tensors are "
                            f"{dtype}; pass tensors of one dtype")


def _check_pairs(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], what: str) -> None:
    if len(outputs) != len(inputs):
        raise ValueError(f"{what}: {len(outputs)} outputs for {len(inputs)} inputs; pass one output per input")


def _rows(tensor: torch.Tensor) -> tuple[int, int]:
    """A tensor's rows (dim 0) and the elements of each (a 0-d tensor: one row of one)."""
    if tensor.dim() == 0:
        return 1, 1
    return tensor.shape[0], math.prod(tensor.shape[1:])


def _splits(given: Sequence[int], rows: int, size: int, which: str) -> list[int]:
    """``all_to_all_single``'s rows to (or from) each rank: the split sizes given, or equal blocks."""
    if not given:
        if rows % size:
            raise ValueError(f"all_to_all_single: the {which}'s {rows} rows do not split evenly over {size} ranks; "
                             "pass split sizes")
        return [rows // size] * size
    splits = [int(n) for n in given]
    if len(splits) != size or min(splits) < 0 or sum(splits) != rows:
        raise ValueError(f"all_to_all_single: {which}_split_sizes {splits} must be {size} non-negative numbers "
                         f"(one per rank) summing to the {which}'s {rows} rows")
    return splits


def _host_out(tensor: torch.Tensor) -> np.ndarray | None:
    """A NumPy view to write `tensor`'s result into directly (a plain CPU tensor), else None."""
    if (tensor.device.type != "cpu" or tensor.dtype is torch.bool or tensor.requires_grad or tensor.is_conj()
            or tensor.is_neg()):
        return None
    try:
        return host_view(tensor)
    except TypeError:
        return None


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` are views of one storage (an in-place collective)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _direct_out(tensor: torch.Tensor, op: mt.ReduceOperation) -> np.ndarray | None:
    """`_host_out` for a reduction whose result has the tensor's dtype (not MEAN of integers)."""
    if op is mt.ReduceOperation.MEAN and not (tensor.is_floating_point() or tensor.is_complex()):
        return None
    return _host_out(tensor)


def _as_torch(result: Any, like: torch.Tensor) -> torch.Tensor:
    """A collective's result as a torch tensor (a NumPy-backed result seen through torch)."""
    if isinstance(result, torch.Tensor):
        return result
    array = result.numpy() if isinstance(result, mt.Tensor) else np.asarray(result)
    if array.dtype != numpy_dtype(like.dtype) and like.dtype is not torch.bool:
        return torch.from_numpy(np.ascontiguousarray(array))
    return torch_view(np.ascontiguousarray(array), like.dtype)


def _held_view(tensor: torch.Tensor, op: mt.ReduceOperation) -> np.ndarray | None:
    """The array a CPU tensor is all-reduced in, held (the result lands there); None to reduce a copy.

    Its NumPy view, or where NumPy cannot show the tensor as it is (a conjugate or negative
    bit, a subclass that refuses) a private copy: whether a tensor takes the held call should
    depend only on what the ranks agree on (device, dtype, op), or one rank would run the held
    call and its peer the ordinary one (a mismatch, if a clear one); mpitensor chooses how a
    held call moves its data. None for a tensor that requires grad (written through NumPy,
    autograd would not see it), a dtype NumPy lacks (bfloat16), and AVG of integers (torch
    casts its float result back, which a held call cannot write).
    """
    if (not tensor.is_cpu or tensor.requires_grad
            or (op is mt.ReduceOperation.MEAN and not (tensor.is_floating_point() or tensor.is_complex()))):
        return None
    detached = tensor.detach()
    try:
        return detached.numpy()
    except (TypeError, RuntimeError):
        pass
    try:
        return detached.resolve_conj().resolve_neg().clone().numpy()
    except (TypeError, RuntimeError):  # a dtype NumPy lacks (bfloat16): every rank alike
        return None


def _start_all_reduce(tensor: torch.Tensor, view: np.ndarray | None, op: mt.ReduceOperation,
                      devices: list[int] | None, factor: float | None) -> Any:
    """Start one tensor's all-reduce: in place through its `view` where it has one."""
    if view is not None:
        # torch's contract (a tensor in a collective is not touched until its work is waited
        # for) is the promise a held call asks for.
        return mt.all_reduce(view, op, devices, held=True)
    if devices is None and factor is None:
        return mt.all_reduce(tensor, op)  # the form the compiled lane takes
    return mt.all_reduce(tensor, op, devices, prescale_factor=factor)


def _reduced_into(tensors: Sequence[torch.Tensor], views: Sequence[np.ndarray | None]) -> Callable[[list[Any]], None]:
    """What writes all-reduce results into their tensors (nothing where one was reduced in place)."""
    def finish(results: list[Any]) -> None:
        for tensor, view, result in zip(tensors, views, results):
            if view is None:
                _copy_one(tensor, result)
                continue
            array = result.numpy()
            if array.ctypes.data != tensor.data_ptr():  # not reduced in place, or in a private copy
                tensor.copy_(torch.from_numpy(array))

    return finish


def _direct_call(tensor: torch.Tensor, opts: Any) -> tuple[np.ndarray, mt.ReduceOperation] | None:
    """The view and operation of a synchronous all-reduce that no check of ours or mpitensor's can refuse.

    A plain CPU tensor that NumPy shows as it is (its own memory: no grad, no conjugate or
    negative bit, a dtype NumPy has). None sends the call the general way, where every check
    runs inside the call's door, and which reduces such a tensor held too (`_held_view`).
    """
    if (type(tensor) is not torch.Tensor or tensor.requires_grad or not tensor.is_cpu
            or tensor.layout is not torch.strided or not tensor.is_contiguous()):
        return None
    op = known_operation(opts.reduceOp)
    if op is None or (op in _BITWISE and (tensor.is_floating_point() or tensor.is_complex())):
        return None
    if op is mt.ReduceOperation.MEAN and not (tensor.is_floating_point() or tensor.is_complex()):
        return None
    try:
        return tensor.numpy(), op
    except (TypeError, RuntimeError):
        return None


def _copy_into(tensors: Sequence[torch.Tensor]) -> Callable[[list[Any]], None]:
    def finish(results: list[Any]) -> None:
        for tensor, result in zip(tensors, results):
            _copy_one(tensor, result)

    return finish


def _noticed(handle: mt.ReceiveTensor) -> Callable[[list[Any]], None]:
    """What raises the error of a sender's notice received (from any rank) into the tensor's own memory."""
    def finish(results: list[Any]) -> None:
        error = notice_error(results[0], handle.source)
        if error is not None:
            raise error

    return finish


def _received_from_any(tensor: torch.Tensor, handle: mt.ReceiveTensor) -> Callable[[list[Any]], None]:
    """What writes a message received from any rank into `tensor`, or raises the error of a sender's notice."""
    def finish(results: list[Any]) -> None:
        _received_into(tensor, handle.source)(results)

    return finish


def _received_into(tensor: torch.Tensor, source: int) -> Callable[[list[Any]], None]:
    """What writes a received message into `tensor`, or raises the error of a sender's notice."""
    def finish(results: list[Any]) -> None:
        error = notice_error(results[0], source)
        if error is not None:
            raise error
        _copy_one(tensor, results[0])

    return finish


def _copy_one(tensor: torch.Tensor, result: Any) -> None:
    fits = type(result) is torch.Tensor and result.shape == tensor.shape
    tensor.copy_(result if fits else _as_torch(result, tensor).reshape(tensor.shape))


def _split_into(outputs: Sequence[torch.Tensor]) -> Callable[[list[Any]], None]:
    def finish(results: list[Any]) -> None:
        flat = _as_torch(results[0], outputs[0]).reshape(-1)
        for output, part in zip(outputs, torch.split(flat, [out.numel() for out in outputs])):
            output.copy_(part.reshape(output.shape))

    return finish


def _joined(works: list[Work], outputs: Any, group: ProcessGroupMpitensor) -> Work:
    """One work that completes the given works in order."""

    def finish(_: list[Any]) -> None:
        for work in works:
            work.wait()

    return group._work((), finish, outputs)
