"""The compiled code reads the runtime's objects through their records only.

The runtime's objects that compiled code touches (ops, tensors, handles, groups, the engine,
the context) derive from the record types of `_core/records.py` (`_core/native/records.h`);
the C files read and write those structs, never a Python object's attribute by name or a
slot at an offset learnt from a Python class. The scan below fails, naming file and line, on
any attribute look-up or method call by name in the C code that is not of a module (mpi4py's,
functools', the records module's).
"""

from __future__ import annotations

import os
import pathlib
import re

import pytest

import mpitensor as mt
from mpitensor._collectives.common import CollectiveTensor
from mpitensor._core import records
from mpitensor._core.tensor import Tensor
from mpitensor._runtime.engine import Engine, Group, Op

ROOT = pathlib.Path(mt.__file__).parent
# Calls that look a Python object's attribute up (or call a method) by name.
_BY_NAME = re.compile(r"PyObject_(GetAttr|SetAttr|DelAttr|HasAttr|CallMethod)\w*\(\s*(\w+)")
# What may be looked up by name: attributes of modules (mpi4py's C API and constants, functools.partial, the
# record types of mpitensor._core._records).
_MODULES = {"module", "records", "functools"}


def _c_sources() -> list[pathlib.Path]:
    return sorted(path for path in ROOT.rglob("*.[ch]") if path.name != "xla_ffi_c_api.h")


def test_no_c_file_reads_a_runtime_object_by_name():
    found = []
    for path in _c_sources():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in _BY_NAME.finditer(line):
                if match.group(2) not in _MODULES:
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
            if "PyMemberDescr" in line or "d_member" in line:
                found.append(f"{path.relative_to(ROOT)}:{number}: a slot's offset taken from a Python class")
    assert not found, "compiled code must read the runtime's objects through their records:\n" + "\n".join(found)


def test_the_runtime_objects_derive_from_their_records():
    assert issubclass(Op, records.OpRecord)
    assert issubclass(Group, records.GroupRecord)
    assert issubclass(Engine, records.EngineRecord)
    assert issubclass(Tensor, records.TensorRecord)
    assert issubclass(CollectiveTensor, records.HandleRecord)
    assert issubclass(mt.DistributedContext, records.ContextRecord)


def test_the_records_are_compiled_where_the_package_was():
    if os.environ.get("MPITENSOR_EXPECT_NATIVE") != "1":
        pytest.skip("not built with a C compiler here (MPITENSOR_EXPECT_NATIVE unset)")
    assert records.compiled, "mpitensor._core._records was not built"


def test_a_tensor_made_without_its_constructor_and_its_record_fields():
    import numpy as np

    from mpitensor._core.tensor import wrap_array

    array = np.arange(3.0)
    device = mt.Device("cpu", 0, 0)
    tensor = wrap_array(array, device)
    assert type(tensor) is Tensor and tensor.array is array and tensor.device == device
    assert Tensor(array).numpy() is array
