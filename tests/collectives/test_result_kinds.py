"""One rule for results: every collective gives its result in the input's kind, dtype and device.

The cases are enumerated from ``mpitensor.__all__``: every public name is either a case here
or listed as no tensor collective, so a new collective without a case fails
`test_every_public_collective_has_a_case`. Each (collective, input kind, dtype) cell checks
the result's type, dtype and device, and its values against a NumPy reference computed from
every rank's input. mpitensor's own kinds (NumPy and CuPy arrays, `Tensor`) give a `Tensor`;
an object that speaks only DLPack has no library to go back to and gives a `Tensor` too.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import mpitensor as mt
from tests.helpers import agree, rank_input, seed_of

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = jax.numpy

DTYPES = ["float32", "int32"]


# -- input kinds ----------------------------------------------------------------------------


class DLPackOnly:
    """An array of a library mpitensor does not know, which speaks only DLPack."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.array.__dlpack_device__()


class APIArray(DLPackOnly):
    """An array of an Array API library: its namespace's ``from_dlpack`` makes its arrays."""

    def __array_namespace__(self, api_version: str | None = None) -> types.SimpleNamespace:
        return API

    def __eq__(self, other: object) -> bool:  # for the object collectives' round trip
        return isinstance(other, APIArray) and np.array_equal(self.array, other.array)

    __hash__ = None  # type: ignore[assignment]


API = types.SimpleNamespace(from_dlpack=lambda value: APIArray(np.from_dlpack(value)))


@dataclass(frozen=True)
class Kind:
    """An input kind: how to make a value of it, and what a result of it must be.

    Attributes:
        name: the kind's name in test ids.
        make: this rank's NumPy data to a value of the kind.
        scalar: True for kinds that are 0-d only (numbers).
        needs_gpu: True for kinds on a CUDA device.
    """

    name: str
    make: Callable[[np.ndarray], Any]
    scalar: bool = False
    needs_gpu: bool = False


def _cupy_of(array: np.ndarray) -> Any:
    import cupy

    return cupy.asarray(array)


def _torch_cuda_of(array: np.ndarray) -> Any:
    return torch.from_numpy(array.copy()).to(f"cuda:{mt.current_context().device.index}")


KINDS = [
    Kind("numpy", lambda a: a.copy()),
    Kind("tensor", lambda a: mt.from_numpy(a.copy())),
    Kind("cupy", _cupy_of, needs_gpu=True),
    Kind("torch", lambda a: torch.from_numpy(a.copy())),
    Kind("torch-cuda", _torch_cuda_of, needs_gpu=True),
    Kind("jax", jnp.asarray),
    Kind("dlpack", lambda a: DLPackOnly(a.copy())),
    Kind("array-api", lambda a: APIArray(a.copy())),
    Kind("python", lambda a: a.item(), scalar=True),
    Kind("numpy-scalar", lambda a: a[()], scalar=True),
]
STRUCTURES = ["list", "dict"]  # of leaves of several kinds, for the collectives that fuse
LEAVES = ("numpy", "torch", "jax", "python")


def data_of(value: Any) -> np.ndarray:
    """The NumPy data a value of any kind holds (what the collective communicates)."""
    if isinstance(value, torch.Tensor):
        return value.cpu().numpy()
    if isinstance(value, mt.Tensor):
        return value.cpu().numpy()
    if isinstance(value, DLPackOnly):
        return value.array
    if type(value).__module__.startswith("cupy"):
        return value.get()
    return np.asarray(value)


def kind_problem(kind: str, source: Any, result: Any, expected: np.ndarray) -> str | None:
    """What is wrong with `result` for an input `source` of `kind`, or None."""
    if isinstance(result, mt.Tensor) != (kind in ("numpy", "tensor", "cupy", "dlpack")
                                         or (kind == "numpy-scalar" and expected.ndim)):
        return f"a {kind} input gave {type(result).__name__}"
    if isinstance(result, mt.Tensor):
        device = source.device if kind == "tensor" else _device_of(kind)
        if result.device == device and result.dtype == expected.dtype:
            return None
        got = f"a Tensor of {result.dtype} on {result.device}"
        return f"a {kind} input gave {got}, expected {expected.dtype} on {device}"
    return _foreign_problem(kind, source, result, expected)


def _device_of(kind: str) -> mt.Device:
    ctx = mt.current_context()
    return ctx.device if kind == "cupy" else ctx.cpu_device


def _foreign_problem(kind: str, source: Any, result: Any, expected: np.ndarray) -> str | None:
    if kind.startswith("torch"):
        wanted = torch.from_numpy(np.zeros(0, expected.dtype)).dtype
        ok = isinstance(result, torch.Tensor) and result.device == source.device and result.dtype == wanted
        return None if ok else f"a {kind} input on {source.device} gave {_describe(result)}, expected {wanted}"
    if kind == "jax":
        wanted = jax.dtypes.canonicalize_dtype(expected.dtype)
        ok = isinstance(result, jax.Array) and result.devices() == source.devices() and result.dtype == wanted
        return None if ok else f"a JAX input gave {_describe(result)}, expected {wanted} on {source.devices()}"
    if kind == "array-api":
        ok = type(result) is APIArray and result.array.dtype == expected.dtype
        return None if ok else f"an Array API input gave {_describe(result)}"
    if kind == "python":
        wanted = type(expected.dtype.type(0).item())
        if expected.ndim == 0:
            return None if type(result) is wanted else f"a Python {wanted.__name__} gave {_describe(result)}"
        ok = type(result) is list and all(type(item) is wanted for item in result)
        return None if ok else f"a Python {wanted.__name__} gave {_describe(result)}, expected a list of them"
    if kind == "numpy-scalar":
        ok = type(result) is expected.dtype.type
        return None if ok else f"a NumPy {expected.dtype} scalar gave {_describe(result)}"
    raise AssertionError(f"no rule for kind {kind}")


def _describe(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__} of {getattr(value, 'dtype', '-')}"


def value_problem(result: Any, expected: np.ndarray) -> str | None:
    """Whether `result` holds `expected`'s values (exactly for integers)."""
    got = np.asarray(result if isinstance(result, list) else data_of(result))
    if got.shape != expected.shape:
        return f"shape {got.shape}, expected {expected.shape}"
    if expected.dtype.kind in "fc":
        close = np.allclose(got.astype(expected.dtype), expected, rtol=1e-5, atol=1e-6)
    else:
        close = np.array_equal(got, expected)
    return None if close else f"values {got.tolist()}, expected {expected.tolist()}"


# -- collectives ----------------------------------------------------------------------------


def _sum(arrays: list[np.ndarray]) -> np.ndarray:
    return functools.reduce(np.add, arrays)


def _flat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.atleast_1d(a) for a in arrays])


def _block(array: np.ndarray, rank: int) -> np.ndarray:
    return array[2 * rank : 2 * rank + 2]


def _exscan(inputs: list[np.ndarray], rank: int) -> np.ndarray:
    return _sum(inputs[:rank]) if rank else np.zeros_like(inputs[0])


@dataclass(frozen=True)
class Case:
    """How a collective is called on this rank's value, and what it gives on a rank.

    Attributes:
        call: ``call(value, ctx)``, the result resolved.
        reference: ``reference(inputs, rank, size)``: the expected result on `rank` from
            every rank's NumPy data, or None where the collective gives None.
        split: True where the input is split along its first axis (no 0-d input).
        fuses: True where lists and dicts of tensors are one call.
        objects: True for the object collectives (results are unpickled objects).
        min_size: the fewest ranks the case runs on.
    """

    call: Callable[[Any, mt.DistributedContext], Any]
    reference: Callable[[list[np.ndarray], int, int], np.ndarray | None]
    split: bool = False
    fuses: bool = False
    objects: bool = False
    min_size: int = 1


def _ring(value: Any, ctx: mt.DistributedContext) -> Any:
    """Send to the next rank, receive into a template of the same kind from the previous one."""
    sent = mt.send(value, (ctx.rank + 1) % ctx.size, tag=7)
    received = mt.recv(value, (ctx.rank - 1) % ctx.size, tag=7).resolve()
    assert sent.resolve() is None
    return received


def _gradient_sync(value: Any, ctx: mt.DistributedContext) -> Any:
    data = data_of(value)
    sync = mt.GradientSync({"w": (data.shape, data.dtype)}, op="sum")
    sync.submit("w", value)
    return sync.wait()["w"]


CASES: dict[str, Case] = {
    "all_reduce": Case(lambda v, c: mt.all_reduce(v, "sum").resolve(), lambda x, r, n: _sum(x), fuses=True),
    "broadcast": Case(lambda v, c: mt.broadcast(v, root=0).resolve(), lambda x, r, n: x[0], fuses=True),
    "reduce": Case(lambda v, c: mt.reduce(v, "sum", root=0).resolve(), lambda x, r, n: _sum(x) if r == 0 else None),
    "all_gather": Case(lambda v, c: mt.all_gather(v).resolve(), lambda x, r, n: _flat(x), fuses=True),
    "reduce_scatter": Case(lambda v, c: mt.reduce_scatter(v, "sum").resolve(), lambda x, r, n: _block(_sum(x), r),
                           split=True, fuses=True),
    "all_to_all": Case(lambda v, c: mt.all_to_all(v).resolve(),
                       lambda x, r, n: np.concatenate([_block(a, r) for a in x]), split=True),
    "gather": Case(lambda v, c: mt.gather(v, 0).resolve(), lambda x, r, n: _flat(x) if r == 0 else None),
    # Every rank passes its own value: the root's to split, elsewhere a template of its kind.
    "scatter": Case(lambda v, c: mt.scatter(v, 0).resolve(), lambda x, r, n: _block(x[0], r), split=True),
    "scan": Case(lambda v, c: mt.scan(v, "sum").resolve(), lambda x, r, n: _sum(x[: r + 1])),
    "exscan": Case(lambda v, c: mt.exscan(v, "sum").resolve(), lambda x, r, n: _exscan(x, r)),
    "send": Case(_ring, lambda x, r, n: x[(r - 1) % n], min_size=2),
    "recv": Case(_ring, lambda x, r, n: x[(r - 1) % n], min_size=2),
    "GradientSync": Case(_gradient_sync, lambda x, r, n: _sum(x)),
    "broadcast_object": Case(lambda v, c: mt.broadcast_object(v, 0).resolve(), lambda x, r, n: x[0], objects=True),
    "all_gather_object": Case(lambda v, c: mt.all_gather_object(v).resolve(), lambda x, r, n: x, objects=True),
    "gather_object": Case(lambda v, c: mt.gather_object(v, 0).resolve(), lambda x, r, n: x if r == 0 else None,
                          objects=True),
}

# Public names that are no collective of tensors, and why.
NOT_COLLECTIVES = {
    "barrier": "takes no tensor and gives None",
    "collective_call": "the door around a call made of several steps (its collectives inside have their cases)",
    "DistributedContext": "opens contexts (its init takes the devices)",
    **dict.fromkeys(["arange", "as_tensor", "empty", "from_numpy", "full", "ones", "tensor", "zeros"],
                    "a factory of local tensors"),
    **dict.fromkeys(["CollectiveTensor", "Device", "DistributedConfig", "ReceiveTensor", "ReduceOperation", "Tensor"],
                    "a type the collectives use"),
    "ANY_SOURCE": "recv's source for a message of any rank",
    "current_context": "a context lookup",
    "defer_finalize": "the MPI lifecycle",
    "trace_region": "marks a phase of the program in the trace",
    "TraceSummary": "the straggler report of a trace",
    "__version__": "the version",
}


def _takes_devices(value: Any) -> bool:
    try:
        return "devices" in inspect.signature(value).parameters
    except (TypeError, ValueError):
        return False


def test_every_public_collective_has_a_case():
    """A public name is a case, an error class, or listed with a reason; collectives cannot be excused."""
    for name in mt.__all__:
        value = getattr(mt, name)
        if isinstance(value, type) and issubclass(value, BaseException):
            continue
        assert name in CASES or name in NOT_COLLECTIVES, (
            f"mpitensor.{name} is public but neither a case of this test nor listed as no tensor collective: "
            "add its Case to CASES (or its reason to NOT_COLLECTIVES)"
        )
        if _takes_devices(value) and name not in CASES:
            assert name in ("barrier", "collective_call"), (
                f"mpitensor.{name} takes devices= like a collective: give it a Case")
    assert set(CASES) <= set(mt.__all__), f"cases of names that are not public: {set(CASES) - set(mt.__all__)}"


# -- the cells ------------------------------------------------------------------------------


def _skip_reason(case: Case, kind: Kind, ctx: mt.DistributedContext) -> str | None:
    if ctx.size < case.min_size:
        return f"needs {case.min_size} ranks"
    if kind.needs_gpu and ctx.device.kind != "cuda":
        return "a CUDA kind, and this rank's device is a CPU"
    return None


def _rank_data(seed: int, rank: int, size: int, dtype: str, scalar: bool) -> np.ndarray:
    shape = () if scalar else (2 * size,)
    return rank_input(seed, rank, shape, dtype)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
@pytest.mark.parametrize("name", sorted(CASES))
def test_results_come_back_in_the_input_kind(module_ctx, name, kind, dtype):
    ctx = module_ctx
    case = CASES[name]
    reason = _skip_reason(case, kind, ctx)
    if reason:
        pytest.skip(reason)
    seed = seed_of(name, kind.name, dtype)
    values = [kind.make(_rank_data(seed, r, ctx.size, dtype, kind.scalar)) for r in range(ctx.size)]
    mine = values[ctx.rank]
    if case.split and kind.scalar:
        with pytest.raises(ValueError, match="at least one dimension"):
            case.call(mine, ctx)
        agree(True, name)
        return
    result = case.call(mine, ctx)
    expected = case.reference([data_of(v) for v in values], ctx.rank, ctx.size)
    problem = _problem(case, kind, mine, result, expected, values)
    agree(problem is None, f"{name} of a {kind.name} {dtype} input: {problem}")


def _problem(case: Case, kind: Kind, source: Any, result: Any, expected: Any, values: list[Any]) -> str | None:
    if expected is None:
        return None if result is None else f"expected None, got {_describe(result)}"
    if case.objects:
        return _object_problem(result, case.reference(values, mt.current_context().rank, len(values)))
    return kind_problem(kind.name, source, result, expected) or value_problem(result, expected)


def _object_problem(result: Any, expected: Any) -> str | None:
    """Unpickled objects: each of the sender's type and data."""
    pairs = zip(result, expected) if isinstance(expected, list) else [(result, expected)]
    for got, want in pairs:
        if type(got) is not type(want):
            return f"an object of {_describe(want)} came back as {_describe(got)}"
        if value_problem(got, data_of(want)) is not None:
            return value_problem(got, data_of(want))
    return None


# -- structures -----------------------------------------------------------------------------


def _structure(kind: str, data: dict[str, np.ndarray]) -> Any:
    leaves = {leaf: next(k for k in KINDS if k.name == leaf).make(array) for leaf, array in data.items()}
    return list(leaves.values()) if kind == "list" else leaves


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c.fuses))
def test_structures_come_back_with_each_leaf_in_its_kind(module_ctx, name, structure, dtype):
    ctx = module_ctx
    case = CASES[name]
    seed = seed_of(name, structure, dtype)
    leaves = [leaf for leaf in LEAVES if not (case.split and leaf == "python")]  # numbers have no axis to split
    data = [{leaf: _rank_data(seed + i, r, ctx.size, dtype, leaf == "python") for i, leaf in enumerate(leaves)}
            for r in range(ctx.size)]
    mine = _structure(structure, data[ctx.rank])
    result = case.call(mine, ctx)
    problems = []
    if type(result) is not type(mine):
        problems.append(f"a {structure} came back as {type(result).__name__}")
    else:
        got = dict(zip(leaves, result)) if structure == "list" else result
        sources = dict(zip(leaves, mine)) if structure == "list" else mine
        for leaf in leaves:
            expected = case.reference([d[leaf] for d in data], ctx.rank, ctx.size)
            problem = kind_problem(leaf, sources[leaf], got[leaf], expected) or value_problem(got[leaf], expected)
            if problem:
                problems.append(f"leaf {leaf}: {problem}")
    agree(not problems, f"{name} of a {structure} of {dtype}: {problems}")
