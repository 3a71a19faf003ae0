"""Whether GPU buffers may go to MPI: the decision table, and what this MPI says.

The decision is a pure function, tested row by row. The library and info-key queries run
against the real MPI of this environment (the PyPI Open MPI and MPICH builds are not
CUDA-aware, and both answer through their MPIX extensions).
"""

from __future__ import annotations

import numpy as np
import pytest

import mpitensor as mt
from mpitensor._core.mpi import MPI
from mpitensor._transport.gpu import cuda_aware as _cuda_aware
from mpitensor._transport.gpu.cuda_aware import (
    BLOCKING,
    DOCUMENTED,
    EVERY,
    NONBLOCKING,
    P2P,
    LibraryAnswer,
    decide,
    detect,
    kinds_support_cuda,
    parse_override,
    vendor_scope,
)

YES = LibraryAnswer(True, "MPIX_Query_cuda_support() in libmpi.so.40 returned 1")
NO = LibraryAnswer(False, "MPIX_Query_cuda_support() in libmpi.so.40 returned 0")
UNKNOWN = LibraryAnswer(None, "the MPI library has no MPIX CUDA query")


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, None), ("", None), ("auto", None), (" detect ", None),
        ("1", True), ("true", True), ("YES", True), ("on", True),
        ("0", False), ("false", False), ("No", False), (" off ", False),
        ("all", "all"), (" ALL ", "all"),
    ],
)
def test_parse_override(raw, expected):
    assert parse_override(raw) == expected and type(parse_override(raw)) is type(expected)


def test_parse_override_rejects_other_values():
    with pytest.raises(ValueError) as info:
        parse_override("maybe")
    assert str(info.value) == (
        "MPITENSOR_CUDA_AWARE must be 1 (MPI takes CUDA buffers where it documents them), all (in "
        "every call), 0 (stage them through host memory) or auto (detect), got 'maybe'"
    )


@pytest.mark.parametrize(
    ("kinds", "expected"),
    [
        (None, None),
        ("", False),
        ("mpi,system", False),
        ("system,mpi,cuda", True),
        ("mpi,cuda:device", True),
        ("cuda:host,cuda:managed", False),
        ("cuda:host,cuda:device", True),
        ("cuda:device:managed", True),
        (" MPI , CUDA ", True),
        ("rocm:device", False),
    ],
)
def test_memory_alloc_kinds(kinds, expected):
    assert kinds_support_cuda(kinds) is expected


# declared (config), override (environment), library, kinds -> aware, source
DECISIONS = [
    (True, None, None, None, True, "config"),
    (False, True, YES, "cuda", False, "config"),
    (True, False, NO, None, True, "config"),
    (None, True, NO, None, True, "environment"),
    (None, False, YES, "cuda", False, "environment"),
    (None, None, YES, None, True, "library"),
    (None, None, YES, "mpi,system", True, "library"),
    (None, None, NO, None, False, "library"),
    (None, None, NO, "cuda:device", False, "library"),  # the library's own "no" is final
    (None, None, UNKNOWN, "mpi,system,cuda:device", True, "info"),
    (None, None, None, "cuda", True, "info"),
    (None, None, UNKNOWN, "mpi,system", False, "default"),
    (None, None, UNKNOWN, "cuda:host", False, "default"),
    (None, None, UNKNOWN, None, False, "default"),
    (None, None, None, None, False, "default"),
]


@pytest.mark.parametrize(("declared", "override", "library", "kinds", "aware", "source"), DECISIONS)
def test_decision_table(declared, override, library, kinds, aware, source):
    decision = decide(declared, override, library, kinds, "MPICH")
    assert (decision.aware, decision.source) == (aware, source)
    assert decision.path == ("cuda-aware" if aware else "staged")


# Which kinds of call take device buffers: vendor, declared, override, library, kinds -> scope.
NOTHING: frozenset[str] = frozenset()
SCOPES = [
    # Open MPI documents point-to-point and blocking collectives; non-blocking collectives
    # depend on the build, so only "all" gives them device buffers.
    ("Open MPI", None, None, YES, None, DOCUMENTED),
    ("Open MPI", None, None, YES, "cuda", DOCUMENTED),
    ("Open MPI", True, None, None, None, DOCUMENTED),
    ("Open MPI", None, True, NO, None, DOCUMENTED),
    ("Open MPI", "all", None, NO, None, EVERY),
    ("Open MPI", None, "all", YES, None, EVERY),
    ("Open MPI", False, "all", YES, None, NOTHING),
    ("Open MPI", None, None, NO, "cuda", NOTHING),
    # MPICH's GPU support covers every operation.
    ("MPICH", None, None, YES, None, EVERY),
    ("MPICH", True, None, None, None, EVERY),
    ("MPICH", None, None, NO, None, NOTHING),
    # MPI 4.1's memory kinds hold for every operation.
    ("Open MPI", None, None, UNKNOWN, "mpi,cuda:device", EVERY),
    # Any other MPI: what Open MPI documents, unless declared "all".
    ("Intel(R) MPI", None, None, YES, None, DOCUMENTED),
    ("", None, True, None, None, DOCUMENTED),
    ("", None, "all", None, None, EVERY),
    ("", None, None, UNKNOWN, None, NOTHING),
]


@pytest.mark.parametrize(("vendor", "declared", "override", "library", "kinds", "scope"), SCOPES)
def test_which_calls_take_device_buffers(vendor, declared, override, library, kinds, scope):
    decision = decide(declared, override, library, kinds, vendor)
    assert decision.scope == scope
    assert decision.aware == bool(scope)
    for operation in (P2P, BLOCKING, NONBLOCKING):
        assert decision.takes(operation) == (operation in scope)


def test_the_path_names_the_calls_when_not_all_take_device_buffers():
    assert decide(None, None, YES, None, "Open MPI").path == "cuda-aware p2p,blocking"
    assert decide(None, "all", None, None, "Open MPI").path == "cuda-aware"
    assert decide(None, 0, None, None, "Open MPI").path == "staged"
    assert vendor_scope("MPICH") == EVERY and vendor_scope("Open MPI") == vendor_scope("other") == DOCUMENTED


def test_config_rejects_other_declarations():
    assert mt.DistributedConfig(cuda_aware="all").cuda_aware == "all"
    with pytest.raises(ValueError, match="cuda_aware must be True, False, 'all' or None, got 'yes'"):
        mt.DistributedConfig(cuda_aware="yes")


def test_decision_details_say_why():
    assert decide(True, None, None, None).detail == "DistributedConfig(cuda_aware=True)"
    assert decide(None, False, None, None).detail == "MPITENSOR_CUDA_AWARE=0"
    assert decide(None, "all", None, None).detail == "MPITENSOR_CUDA_AWARE=all"
    assert decide("all", None, None, None).detail == "DistributedConfig(cuda_aware='all')"
    assert decide(None, None, NO, None).detail == NO.detail
    assert decide(None, None, UNKNOWN, "mpi,cuda").detail == (
        "mpi_memory_alloc_kinds='mpi,cuda' lists CUDA device memory"
    )
    assert decide(None, None, UNKNOWN, "mpi,system").detail == (
        "not detected (the MPI library has no MPIX CUDA query; "
        "mpi_memory_alloc_kinds='mpi,system' lists no CUDA device memory)"
    )
    assert decide(None, None, UNKNOWN, None).detail == (
        "not detected (the MPI library has no MPIX CUDA query; no mpi_memory_alloc_kinds info key)"
    )


def test_detect_reads_the_environment_before_asking_mpi():
    assert detect(None, {"MPITENSOR_CUDA_AWARE": "1"}).source == "environment"
    assert detect(False, {"MPITENSOR_CUDA_AWARE": "1"}).aware is False
    with pytest.raises(ValueError, match=r"MPITENSOR_CUDA_AWARE must be 1 .* got 'cuda'"):
        detect(None, {"MPITENSOR_CUDA_AWARE": "cuda"})


# -- the real MPI ----------------------------------------------------------------------------


@pytest.mark.mpi
def test_this_mpi_answers_through_its_extension(ctx):
    answer = _cuda_aware.query_library()
    name = MPI.get_vendor()[0]
    # Both PyPI builds export an MPIX query; neither is built with CUDA.
    if name in ("Open MPI", "MPICH"):
        assert answer.supported is not None, answer.detail
        assert "MPIX_" in answer.detail
    if answer.supported is not None:
        assert answer.detail.endswith(str(int(answer.supported)))


@pytest.mark.mpi
def test_this_mpi_info_key_agrees_with_the_parser(ctx):
    kinds = _cuda_aware.query_info_kinds()
    major, minor = MPI.Get_version()
    if (major, minor) >= (4, 1):
        assert kinds is not None, "an MPI 4.1 library reports mpi_memory_alloc_kinds"
        assert "system" in kinds.split(",")
    if kinds is not None:
        assert kinds_support_cuda(kinds) in (True, False)


@pytest.mark.mpi
def test_detection_follows_the_table_on_this_mpi(ctx, monkeypatch):
    monkeypatch.delenv("MPITENSOR_CUDA_AWARE", raising=False)
    decision = detect()
    expected = decide(None, None, _cuda_aware.query_library(), _cuda_aware.query_info_kinds())
    assert decision == expected
    assert decision.source in ("library", "info", "default")


@pytest.mark.mpi
@pytest.mark.parametrize(("raw", "path"), [("1", None), ("all", "cuda-aware"), ("0", "staged")])
def test_environment_override_sets_the_data_path(monkeypatch, raw, path):
    from mpitensor._transport.gpu.data_path import data_path, data_path_name

    if path is None:
        path = "cuda-aware" if MPI.get_vendor()[0] == "MPICH" else "cuda-aware p2p,blocking"
    monkeypatch.setenv("MPITENSOR_CUDA_AWARE", raw)
    with mt.DistributedContext.init() as ctx:
        assert data_path(ctx) == path
        assert data_path_name(ctx) == path


@pytest.mark.mpi
def test_config_beats_the_environment(monkeypatch):
    from mpitensor._transport.gpu.data_path import cuda_awareness, data_path

    monkeypatch.setenv("MPITENSOR_CUDA_AWARE", "0")
    with mt.DistributedContext.init(config=mt.DistributedConfig(cuda_aware="all")) as ctx:
        assert data_path(ctx) == "cuda-aware"
        assert cuda_awareness(ctx).detail == "DistributedConfig(cuda_aware='all')"
    with mt.DistributedContext.init(config=mt.DistributedConfig(cuda_aware=True)) as ctx:
        assert data_path(ctx).startswith("cuda-aware")
        assert cuda_awareness(ctx).detail == "DistributedConfig(cuda_aware=True)"


@pytest.mark.mpi
def test_user_defined_ops_never_get_device_buffers(monkeypatch):
    from mpitensor._core.dtypes import reduce_plan
    from mpitensor._transport.gpu.data_path import device_buffers_ok

    monkeypatch.setenv("MPITENSOR_CUDA_AWARE", "all")
    with mt.DistributedContext.init() as ctx:
        complex_max = reduce_plan(mt.ReduceOperation.MAX, np.dtype(np.complex64)).mpi_op
        assert not complex_max.is_predefined
        assert device_buffers_ok(ctx, MPI.SUM)
        assert device_buffers_ok(ctx)
        assert not device_buffers_ok(ctx, complex_max)
    monkeypatch.setenv("MPITENSOR_CUDA_AWARE", "0")
    with mt.DistributedContext.init() as ctx:
        assert not device_buffers_ok(ctx, MPI.SUM)
        assert not device_buffers_ok(ctx)


@pytest.mark.mpi
def test_a_declared_yes_covers_non_blocking_reductions_only_where_this_mpi_documents_them(monkeypatch):
    from mpitensor._transport.gpu.data_path import device_buffers_ok

    monkeypatch.setenv("MPITENSOR_CUDA_AWARE", "1")
    with mt.DistributedContext.init() as ctx:
        assert device_buffers_ok(ctx, MPI.SUM, P2P)
        assert device_buffers_ok(ctx, MPI.SUM, BLOCKING)
        # mpitensor's all_reduce posts MPI_Iallreduce: staged on Open MPI unless declared "all".
        assert device_buffers_ok(ctx, MPI.SUM) == (MPI.get_vendor()[0] == "MPICH")
