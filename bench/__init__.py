"""Benchmarks of datagen, and its fault scenarios at scale (``bench.reliability``).

Not installed: they run from a source checkout, and the fault scenarios share the
tests' fault kit (``tests/faultkit*.py``). Each benchmark drives ``datagen sim`` run as a
separate process.

Run them all with ``python -m bench [--quick]``, or one with
``python -m bench.<name> [--quick]`` (saturation, overhead, producer, guard, overshoot,
memory, scaling). Every script prints a table and one ``bench-result {json}`` line.
They use Redis DB 11 (``DATAGEN_BENCH_REDIS_URL``), SQLite files under
``DATAGEN_BENCH_DIR`` (default /tmp/datagen-bench) and the PostgreSQL database ``bench``
(``DATAGEN_BENCH_POSTGRES_URL``); they flush and recreate all three freely.
"""
