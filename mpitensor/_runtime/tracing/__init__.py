"""Collective tracing: what each rank recorded, merged into a Chrome/Perfetto trace and a straggler report."""
