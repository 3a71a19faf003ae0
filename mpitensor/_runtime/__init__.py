"""Contexts and groups, the engine (checks, ordering, waiting), diagnosis, progress, fail-fast."""
