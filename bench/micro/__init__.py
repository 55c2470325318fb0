"""Micro-benchmarks: the cost of one piece of the request path, in process, each runnable on
its own and printing its figures.

- ``python -m bench.micro.admission_cost``: the admission core and gate with 10 to 10,000
  waiters (``bench.overhead`` runs the same step and holds it to its target);
- ``python -m bench.micro.tenant_cost``: the fair order with 1 tenant, 10,000 tracked and fresh
  keys (``bench.overhead`` runs it too);
- ``python -m bench.micro.prompt_estimate``: the prompt estimate without a tokenizer against
  two real tokenizers, on text of many scripts;
- ``python -m bench.micro.redis_rtt``: the shared pool's Redis script calls and the hand-over
  between replicas, against a throwaway redis-server.

Percentiles are ``bench.common.stats.percentile``'s. The whole request path, through Envoy, is
``bench.overhead``'s; these say where its time goes, one piece at a time.
"""
