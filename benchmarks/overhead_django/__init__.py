"""The Django stack of benchmarks/overhead.py: one view with an N+1 of 10 queries on PostgreSQL.

``GET /orders/<id>`` loads the order with its customer (one join), its 10 lines (one query),
and each line's product through the foreign key (10 queries: the N+1). The tables are the
benchmark's own (``bench_overhead_*``, seeded by overhead.py), not managed by Django.
Settings: ``overhead_django.settings`` (the database from ``PERFSLEUTH_BENCH_PG``).
"""
