"""How bytes move: MPI's own data calls, shared memory within a node, GPU staging and CUDA-aware MPI.

The collectives make no data MPI call themselves: `mpi` holds them (functions per family,
and the all-reduce's transports).
"""
