"""Raw mpi4py beside mpitensor, in every order, in child jobs of 2 ranks.

``import mpitensor`` must leave mpi4py as the program would find it without mpitensor: a
raw call after it works, a program that used mpi4py first keeps its MPI, and MPI is not
finalized under a program that still holds mpi4py when the last context closes. Every
sum is compared with the one computed from every rank's input.
"""

from __future__ import annotations

import importlib.util
import re

import pytest

from tests.helpers import ROOT, run_job

pytestmark = pytest.mark.subprocess

# Each rank contributes rank + 1: the sum over 2 ranks is 3.
RAW = "MPI.COMM_WORLD.allreduce(MPI.COMM_WORLD.Get_rank() + 1)"
MINE = "mt.all_reduce(np.full(2, ctx.rank + 1.0)).resolve().numpy().tolist()"

ORDERS = {
    "mpitensor, then mpi4py, then a context": f"""
        import numpy as np
        import mpitensor as mt
        from mpi4py import MPI
        report("raw before", {RAW})
        with mt.DistributedContext.init() as ctx:
            report("context", {MINE})
        report("raw after", {RAW}, MPI.Is_finalized())
        """,
    "mpi4py first, then mpitensor": f"""
        from mpi4py import MPI
        report("raw before", {RAW})
        import numpy as np
        import mpitensor as mt
        with mt.DistributedContext.init() as ctx:
            report("context", {MINE})
        report("raw after", {RAW}, MPI.Is_finalized())
        """,
    "a context, then mpi4py inside it": f"""
        import numpy as np
        import mpitensor as mt
        with mt.DistributedContext.init() as ctx:
            from mpi4py import MPI
            report("raw before", {RAW})
            report("context", {MINE})
        report("raw after", {RAW}, MPI.Is_finalized())
        """,
    "two contexts, mpi4py held": f"""
        import numpy as np
        import mpitensor as mt
        from mpi4py import MPI
        with mt.DistributedContext.init() as ctx:
            report("raw before", {RAW})
        with mt.DistributedContext.init() as ctx:
            report("context", {MINE})
        report("raw after", {RAW}, MPI.Is_finalized())
        """,
}


@pytest.mark.parametrize("order", list(ORDERS))
def test_raw_mpi4py_works_in_every_order(tmp_path, order):
    result = run_job(ORDERS[order], 2, tmp_path=tmp_path)
    assert result.returncode == 0, result.output
    assert result.reported("raw before") == ["raw before 3"] * 2, result.output
    assert result.reported("context") == ["context [3.0, 3.0]"] * 2, result.output
    # MPI stays up after the last close for the program that still holds mpi4py.
    assert result.reported("raw after") == ["raw after 3 False"] * 2, result.output


def test_mpitensor_alone_finalizes_at_the_last_close(tmp_path):
    result = run_job(
        f"""
        import sys
        import numpy as np
        import mpitensor as mt
        with mt.DistributedContext.init() as ctx:
            report("context", {MINE})
        report("finalized", sys.modules["mpi4py.MPI"].Is_finalized())
        """,
        2,
        tmp_path=tmp_path,
    )
    assert result.returncode == 0, result.output
    assert result.reported("context") == ["context [3.0, 3.0]"] * 2
    assert result.reported("finalized") == ["finalized True"] * 2


def test_import_leaves_mpi4py_and_its_rc_untouched(tmp_path):
    result = run_job(
        """
        import sys
        import mpi4py
        before = (mpi4py.rc.initialize, mpi4py.rc.finalize, mpi4py.rc.thread_level)
        import mpitensor
        import mpitensor.torch
        after = (mpi4py.rc.initialize, mpi4py.rc.finalize, mpi4py.rc.thread_level)
        report("state", "mpi4py.MPI" in sys.modules, before == after)
        from mpi4py import MPI
        report("initialized", MPI.Is_initialized(), MPI.COMM_WORLD.Get_size())
        """,
        2,
        tmp_path=tmp_path,
    )
    assert result.returncode == 0, result.output
    assert result.reported("state") == ["state False True"] * 2
    assert result.reported("initialized") == ["initialized True 2"] * 2


def test_the_readme_example_runs_after_mpi4py(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    readme = (ROOT / "README.md").read_text()
    example = re.search(r"## Example\n\n```python\n(.*?)```", readme, re.S)
    assert example is not None, "README.md has no ## Example python block"
    script = "from mpi4py import MPI\nreport('raw', MPI.COMM_WORLD.allreduce(1))\n" + example.group(1)
    script += "report('done', MPI.Is_finalized())\n"
    result = run_job(script, 2, timeout=120, tmp_path=tmp_path)
    assert result.returncode == 0, result.output
    assert result.reported("raw") == ["raw 2"] * 2
    assert result.reported("done") == ["done False"] * 2
    assert "[2.5 2.5 2.5 2.5]" not in result.stdout  # 4 ranks' figure; on 2 ranks the mean is 1.5
    assert "[1.5 1.5 1.5 1.5]" in result.stdout, result.output


MPI4JAX_ORDERS = {
    "mpitensor and mpi4jax imported, mpi4jax called before any context": """
        import numpy as np
        import jax, jax.numpy as jnp
        import mpitensor as mt
        import mpi4jax
        from mpi4py import MPI
        x = jnp.full(2, MPI.COMM_WORLD.Get_rank() + 1.0)
        report("raw before", mpi4jax.allreduce(x, op=MPI.SUM).tolist())
        with mt.DistributedContext.init() as ctx:
            import mpitensor.jax as mtj
            report("context", jax.jit(mtj.all_reduce)(x).tolist())
        report("raw after", jax.jit(lambda v: mpi4jax.allreduce(v, op=MPI.SUM))(x).tolist(), MPI.Is_finalized())
        """,
    "mpi4jax and mpitensor.jax alternating inside one context": """
        import numpy as np
        import jax, jax.numpy as jnp
        import mpi4jax
        import mpitensor as mt
        import mpitensor.jax as mtj
        from mpi4py import MPI
        with mt.DistributedContext.init() as ctx:
            x = jnp.full(2, ctx.rank + 1.0)
            theirs = jax.jit(lambda v: mpi4jax.allreduce(v, op=MPI.SUM))
            ours = jax.jit(mtj.all_reduce)
            report("raw before", theirs(x).tolist())
            report("context", ours(theirs(x) / 2).tolist())
        report("raw after", theirs(x).tolist(), MPI.Is_finalized())
        """,
}


@pytest.mark.parametrize("order", list(MPI4JAX_ORDERS))
def test_mpi4jax_works_beside_mpitensor(tmp_path, order):
    pytest.importorskip("jax")
    # Looked up, not imported: importing mpi4jax would initialize MPI in this process.
    if importlib.util.find_spec("mpi4jax") is None:
        pytest.skip("mpi4jax is not installed (make-venv.sh builds it where the MPI has mpicc)")
    result = run_job(MPI4JAX_ORDERS[order], 2, timeout=120, tmp_path=tmp_path)
    assert result.returncode == 0, result.output
    assert result.reported("raw before") == ["raw before [3.0, 3.0]"] * 2, result.output
    assert result.reported("context") == ["context [3.0, 3.0]"] * 2, result.output
    assert result.reported("raw after") == ["raw after [3.0, 3.0] False"] * 2, result.output
