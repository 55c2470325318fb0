"""The test harness that tests, ``make demo`` and the benchmarks share.

``testing.stack`` starts the real pieces on 127.0.0.1 (a backend, the sidecar, Envoy),
``testing.envoy`` builds (from the shipped configs and ``extproc.config.envoy_objects``)
and checks the Envoy configs for them,
``testing.harness`` reads the sidecar's metrics back and waits on them, ``testing.wait`` is the
bounded wait for an event that tests use instead of sleeping, ``testing.clients`` the clients
tests and ``bench.bounds`` share, ``testing.clock`` an asyncio loop on a virtual clock,
``testing.leases`` shared-pool lease managers on a fake local pool (for the same two),
``testing.tools`` what a test needs beyond Python (the markers' check), ``testing.backend`` is
a small OpenAI-compatible stand-in, ``testing.recorder`` a backend that records every
request's start and end (``testing.inflight`` reads that history), ``testing.tcp_proxy`` a TCP
proxy a test cuts, slows or moves, ``testing.faults``, ``testing.fault_load`` and
``testing.fault_cases`` the shared pool's fault-injection suite
(``tests/shared/test_fault_injection.py``, ``python -m bench.faults``), and
``testing.dockerfile`` reads the Dockerfile and its build context without a Docker engine.
Not shipped in the package: it lives beside ``extproc/`` in the repository.
"""
