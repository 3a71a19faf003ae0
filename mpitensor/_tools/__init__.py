"""Tools on top of the public API: the `python -m mpitensor info` table."""
