"""The build of mpitensor's compiled parts: the small all-reduces' lane, the kernels, the trace ring, the JAX handler.

The lane of repeated small all-reduces, and the shared-memory all-reduce's streaming sum:
both are optional: where no C compiler is found (or a build fails), mpitensor installs
without them and Python takes every call (`python -m mpitensor info` says which). The C
code needs Python's and NumPy's headers only, not MPI's: the lane finds MPI's functions at
run time in the library mpi4py loaded (see mpitensor/_collectives/native/__init__.py).
"""

from setuptools import Extension, setup

_SOURCES = ["module.c", "abi.c", "check.c", "rows.c", "keys.c", "lane.c", "finish.c", "entry.c", "handle.c", "leaves.c"]


def _extensions() -> list[Extension]:
    try:
        import numpy
    except ImportError:  # a build without isolation, and no NumPy: the Python lanes only
        return []
    return [
        Extension(
            "mpitensor._core.kernels._streaming",
            sources=["mpitensor/_core/kernels/streaming.c"],
            include_dirs=[numpy.get_include()],
            extra_compile_args=["-O2", "-fno-fast-math", "-ffp-contract=off"],
            optional=True,
        ),
        # The records of the runtime's objects that the compiled lane reads (native/records.h).
        Extension(
            "mpitensor._core._records",
            sources=["mpitensor/_core/native/records.c"],
            depends=["mpitensor/_core/native/records.h"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        # The idle rule inside Open MPI's blocking calls (_core/idle.py).
        Extension(
            "mpitensor._core._idle",
            sources=["mpitensor/_core/native/idle.c"],
            depends=["mpitensor/_core/native/idle.h"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        # Two ranks of one node exchanging through shared memory, waiting on futexes (_transport/mpi/pair.py).
        Extension(
            "mpitensor._core._pair",
            sources=["mpitensor/_core/native/pair.c"],
            depends=["mpitensor/_core/native/pair.h"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "mpitensor._core.kernels._keys",
            sources=["mpitensor/_core/kernels/keys.c"],
            depends=["mpitensor/_core/kernels/keys.h"],
            include_dirs=[numpy.get_include()],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "mpitensor._collectives.native._lanes",
            sources=[f"mpitensor/_collectives/native/{name}" for name in _SOURCES],
            depends=["mpitensor/_collectives/native/native.h", "mpitensor/_runtime/tracing/native/ring_api.h",
                     "mpitensor/_core/kernels/keys.h", "mpitensor/_core/native/records.h",
                     "mpitensor/_core/native/idle.h", "mpitensor/_core/native/pair.h"],
            include_dirs=[numpy.get_include(), "mpitensor/_runtime/tracing/native", "mpitensor/_core/kernels",
                          "mpitensor/_core/native"],
            # Strict IEEE arithmetic: the reductions must give NumPy's bits, never fused or reordered.
            extra_compile_args=["-O2", "-fno-fast-math", "-ffp-contract=off"],
            libraries=["dl"],
            optional=True,
        ),
        # The record of collectives that tracing keeps (DistributedConfig(trace=...)).
        Extension(
            "mpitensor._runtime.tracing._ring",
            sources=["mpitensor/_runtime/tracing/native/ring.c"],
            depends=["mpitensor/_runtime/tracing/native/ring_api.h"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        # The XLA FFI handler of mpitensor.jax: built against the FFI's C header beside it,
        # so the build needs no jaxlib.
        Extension(
            "mpitensor.jax._ffi",
            sources=["mpitensor/jax/native/ffi.c"],
            depends=["mpitensor/jax/native/xla_ffi_c_api.h"],
            include_dirs=[numpy.get_include()],
            extra_compile_args=["-O2"],
            optional=True,
        ),
    ]


setup(ext_modules=_extensions())
