"""ReduceOperation and DistributedConfig (pure logic, no MPI)."""

from __future__ import annotations

import dataclasses

import pytest

import mpitensor as mt
from mpitensor._core.config import parse_op


def test_reduce_operations_mirror_the_seed_and_go_beyond():
    assert [op.name for op in mt.ReduceOperation] == ["SUM", "MEAN", "MAX", "MIN", "PROD", "BAND", "BOR",
                                                           "BXOR"]


def test_parse_op_accepts_members_and_names():
    assert parse_op(mt.ReduceOperation.MAX) is mt.ReduceOperation.MAX
    assert parse_op("Mean") is mt.ReduceOperation.MEAN
    assert parse_op("avg") is parse_op("AVERAGE") is parse_op("Avg") is mt.ReduceOperation.MEAN
    with pytest.raises(ValueError, match="unknown reduce operation 'median'; expected one of SUM, MEAN, MAX, MIN"):
        parse_op("median")
    with pytest.raises(TypeError, match="op must be a ReduceOperation"):
        parse_op(1)


def test_config_defaults_and_immutability():
    config = mt.DistributedConfig()
    assert config.all_reduce_op is mt.ReduceOperation.SUM
    assert config.check is True
    assert config.timeout is None
    assert config.bucket_bytes == 25 * 1024 * 1024
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.check = False  # type: ignore[misc]
    assert mt.DistributedConfig(all_reduce_op="mean").all_reduce_op is mt.ReduceOperation.MEAN


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"timeout": 0}, "timeout must be a positive number of seconds or None, got 0"),
        ({"timeout": float("inf")}, "timeout must be a positive number"),
        ({"check_grace": -1}, "check_grace must be >= 0 seconds"),
        ({"bucket_bytes": 0}, "bucket_bytes must be a positive int, got 0"),
        ({"bucket_bytes": 1.5}, "bucket_bytes must be a positive int"),
        ({"device": "tpu"}, "device must be 'cpu', 'cuda' or None, got 'tpu'"),
        ({"all_reduce_op": "median"}, "unknown reduce operation 'median'"),
    ],
)
def test_bad_settings_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        mt.DistributedConfig(**kwargs)


def test_timeout_from_the_environment(monkeypatch):
    monkeypatch.setenv("MPITENSOR_TIMEOUT", "2.5")
    assert mt.DistributedConfig().resolved_timeout() == 2.5
    assert mt.DistributedConfig(timeout=1.0).resolved_timeout() == 1.0
    monkeypatch.setenv("MPITENSOR_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="MPITENSOR_TIMEOUT must be a positive number of seconds, got 'soon'"):
        mt.DistributedConfig().resolved_timeout()
    monkeypatch.delenv("MPITENSOR_TIMEOUT")
    assert mt.DistributedConfig().resolved_timeout() is None
