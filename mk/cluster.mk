# Cluster tests: a real single-node Slurm (test-slurm) and one MPI job across three hosts
# made of network namespaces (test-multihost). Each installs what it needs (apt-get, the
# venvs), skips with one line where it cannot run (not root, no `ip netns`, no apt-get),
# and fails when a check fails. See scripts/test-slurm.sh, scripts/test-multihost.sh and
# docs/cluster.md.
.PHONY: test-cluster test-slurm test-multihost

test-cluster: test-slurm test-multihost

test-slurm:
	timeout -k 10 900 scripts/test-slurm.sh

test-multihost:
	timeout -k 10 900 scripts/test-multihost.sh
