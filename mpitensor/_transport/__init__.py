"""How bytes move: shared memory within a node, GPU staging and CUDA-aware MPI."""
