"""Running: the matrix runner, the per-run worker process, measurement helpers."""
