# `make test-sanitize`: the compiled parts built with AddressSanitizer and UBSan in a copy of
# the package (build/sanitize), and the tests that drive them run there at 1 and 2 ranks.
# Not part of `make test` (a few minutes, and a C compiler with the sanitizer runtimes).
#   make test-sanitize MPI=mpich     with MPICH's venv instead of Open MPI's
.PHONY: test-sanitize

SANITIZE_VENV ?= .venv-$(MPI)

test-sanitize:
	@scripts/make-venv.sh $(SANITIZE_VENV) $(MPI)
	scripts/test-sanitize.sh $(SANITIZE_VENV)
