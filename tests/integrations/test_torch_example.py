"""examples/torch_data_parallel.py: its data-parallel weights equal a single process's."""

from __future__ import annotations

import pytest

from tests.helpers import ROOT, run_job

pytest.importorskip("torch")
pytest.importorskip("sklearn")
pytestmark = pytest.mark.subprocess


def test_the_torch_example_agrees_with_a_single_process(tmp_path):
    example = ROOT / "examples" / "torch_data_parallel.py"
    result = run_job(
        f"""
        import runpy, sys
        sys.argv = [{str(example)!r}, "--epochs", "2"]
        runpy.run_path(sys.argv[0], run_name="__main__")
        """,
        2,
        timeout=240,
        tmp_path=tmp_path,
    )
    assert result.returncode == 0, result.output
    assert "round-off level: they agree" in result.stdout, result.output
    assert "2 rank(s), 2 epochs" in result.stdout
