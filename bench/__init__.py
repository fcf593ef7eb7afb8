"""ztate's benchmark suite: end-to-end commits against floors measured in the same run.

``make bench`` (``python -m bench``) starts everything it needs by itself (an
embedded Postgres unless ``DATABASE_URL`` is set, a throw-away PKI, HMAC keyring
and database, the servers as child processes) and prints one report. Absolute
figures on a shared 2-core machine move by tens of percent between runs, so the
figures that matter are ratios against a floor and a ceiling measured in the same
run, minutes apart:

(a) **floor**: the commit alone. Raw asyncpg runs the transition store's own
    one-statement ``COMMIT`` (compare-and-swap on the head plus the ledger insert)
    against the migrated schema, each worker on its own thread. No service can
    commit faster than its database does.
(b) **ceiling**: a 1 KB echo over grpc.aio with the transition service's mTLS
    set-up, the server in its own process. No service built on grpc.aio can
    answer faster than an RPC that does nothing.
(c) **ztate**: ``ProposeTransition`` with a 1 KB patch through the worker SDK to
    ``ztate serve`` in its own process, each worker proposing sequentially on its
    own thread against the version it last committed.

(d) **langgraph**: LangGraph's ``AsyncPostgresSaver.aput`` writing the same
    states, one saver per worker: what most users would pick instead, with no
    authentication, validation, compare-and-swap or signature.

Each runs closed-loop at concurrency 1, 32 and 128 after a short warm-up, for a fixed
duration, in interleaved rounds; the best round counts. The report gives
commits/s, p50 and p99 latency, and CPU per operation of the load generator, the
server and Postgres (read from ``/proc``), which says where the time went, beside
the CPU every other process on the machine used meanwhile, which says whether the
figure was disturbed. Then the proposal pipeline's own CPU per proposal, without
I/O, step by step for 1 KB and 10 KB patches, with ``rfc8785.dumps`` of the same
value as the reference; then the service's resident memory at 10,000 active
threads (``bench/memory.py``).

The same run then measures, each in a database of its own, verification
throughput against a hashing floor (``bench/verify.py``) and operator query
latency on a ledger of 1,000,000 transitions (``bench/ledger_queries.py``), and
LangGraph on ztate (``bench/langgraph_graph.py``): checkpoint put/get through
``ZtateCheckpointSaver`` against ``AsyncPostgresSaver``, and the per-step cost of the
four-node pipeline as a graph run in memory, on either saver, and isolated (each node
a worker process); ``--only end-to-end|verify|ledger-queries|langgraph`` runs one part
alone.

The targets tracked: ztate >= 0.6 x the gRPC ceiling at concurrency 32, and at
most 50 µs of pipeline CPU for a 1 KB patch. The verdicts are printed as measured.
"""
