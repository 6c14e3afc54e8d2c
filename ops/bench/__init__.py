"""Benchmarks of datagen, each against ``datagen sim`` run as a separate process.

Run them all with ``python -m ops.bench [--quick]``, or one with
``python -m ops.bench.<name> [--quick]`` (saturation, overhead, producer, guard, overshoot,
memory, scaling). Every script prints a table and one ``bench-result {json}`` line.
They use Redis DB 11 (``DATAGEN_BENCH_REDIS_URL``), SQLite files under
``DATAGEN_BENCH_DIR`` (default /tmp/datagen-bench) and the PostgreSQL database ``bench``
(``DATAGEN_BENCH_POSTGRES_URL``); they flush and recreate all three freely.
"""
