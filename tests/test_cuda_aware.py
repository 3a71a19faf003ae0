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
from mpitensor._transport.gpu.cuda_aware import LibraryAnswer, decide, detect, kinds_support_cuda, parse_override

YES = LibraryAnswer(True, "MPIX_Query_cuda_support() in libmpi.so.40 returned 1")
NO = LibraryAnswer(False, "MPIX_Query_cuda_support() in libmpi.so.40 returned 0")
UNKNOWN = LibraryAnswer(None, "the MPI library has no MPIX CUDA query")


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, None), ("", None), ("auto", None), (" detect ", None),
        ("1", True), ("true", True), ("YES", True), ("on", True),
        ("0", False), ("false", False), ("No", False), (" off ", False),
    ],
)
def test_parse_override(raw, expected):
    assert parse_override(raw) is expected


def test_parse_override_rejects_other_values():
    with pytest.raises(ValueError) as info:
        parse_override("maybe")
    assert str(info.value) == (
        "MPITENSOR_CUDA_AWARE must be 1 (MPI takes CUDA buffers), 0 (stage them through host "
        "memory) or auto (detect), got 'maybe'"
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
    decision = decide(declared, override, library, kinds)
    assert (decision.aware, decision.source) == (aware, source)
    assert decision.path == ("cuda-aware" if aware else "staged")


def test_decision_details_say_why():
    assert decide(True, None, None, None).detail == "DistributedConfig(cuda_aware=True)"
    assert decide(None, False, None, None).detail == "MPITENSOR_CUDA_AWARE=0"
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
@pytest.mark.parametrize(("raw", "path"), [("1", "cuda-aware"), ("0", "staged")])
def test_environment_override_sets_the_data_path(monkeypatch, raw, path):
    from mpitensor._collectives.gpu_staged import data_path, data_path_name

    monkeypatch.setenv("MPITENSOR_CUDA_AWARE", raw)
    with mt.DistributedContext.init() as ctx:
        assert data_path(ctx) == path
        assert data_path_name(ctx) == path


@pytest.mark.mpi
def test_config_beats_the_environment(monkeypatch):
    from mpitensor._collectives.gpu_staged import cuda_awareness, data_path

    monkeypatch.setenv("MPITENSOR_CUDA_AWARE", "0")
    with mt.DistributedContext.init(config=mt.DistributedConfig(cuda_aware=True)) as ctx:
        assert data_path(ctx) == "cuda-aware"
        assert cuda_awareness(ctx).detail == "DistributedConfig(cuda_aware=True)"


@pytest.mark.mpi
def test_user_defined_ops_never_get_device_buffers(monkeypatch):
    from mpitensor._collectives.gpu_staged import device_buffers_ok
    from mpitensor._core.dtypes import reduce_plan

    monkeypatch.setenv("MPITENSOR_CUDA_AWARE", "1")
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
