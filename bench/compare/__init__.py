"""``python -m bench.compare``: admission strategies side by side, same workload, same simulator.

What it measures
----------------
Admission strategies, each run against a *fresh* simulator (:mod:`bench.sim`, one profile, one
speedup) with the *same* open-loop schedule (:mod:`bench.load.workload`, one seed) on each run
of each scenario (:mod:`.scenarios`: ``steady`` at each offered load, ``shift``, ``halve``,
``spike``). The strategies: the peers the sidecar is measured against, each defined in
:mod:`.baselines` (``direct``: the simulator's own FCFS queue; ``envoy-cb-default`` and
``envoy-cb``: Envoy's circuit breakers at ``max_num_seqs`` and at the model's C;
``envoy-adaptive``: Envoy's adaptive_concurrency filter; ``priority-gateway``: a small
short-first gateway of C workers, :mod:`bench.gateway`), and the sidecar's own, defined in
:mod:`.strategies` (``sidecar-static``: a fixed split of C slots between an ``interactive``
and a ``batch`` bucket; ``sidecar``: one pool whose limit the sidecar derives from the
simulators' metrics against latency objectives, C only its static fallback).

Many tenants, one backend (not in the default list)
---------------------------------------------------
``--scenario noisy`` (:mod:`.scenarios`) is the noisy neighbour: interactive requests only, one
``heavy`` tenant at 5x interactive's own capacity and four light ones at 0.2x each, each
request with its ``x-tenant-id`` (:mod:`bench.load`'s ``ClassSpec.tenants``), one run per
``--noisy-seeds`` entry and, per seed, its reference: the light tenants alone, the very same
requests, through one strategy (the held one). Its strategies when none are named:
``sidecar-fair`` (``sidecar``'s policy with tenants by ``x-tenant-id`` and ``order: fair`` in
every bucket, :mod:`.strategies`), ``sidecar``, ``priority-gateway`` and ``envoy-cb``; a
diagnostic, ``sidecar-fifo`` (``sidecar`` with every queue ``fifo``), only when named. Per
tenant (:mod:`.tenants`): SLO attainment over every request it sent (resolved in the window)
and good tokens/s; :mod:`.noisy` prints a table per strategy and checks the targets.

Every Envoy with the sidecar runs with what ``render(policy)`` derives (max_message_timeout,
stream_idle_timeout, route timeouts, the sidecar cluster's breakers), so a queue deadline above
envoy.yaml's is honoured.

Several replicas (not in the default list)
------------------------------------------
Three more strategies (:mod:`.strategies`) put ``--replicas`` (3) gateways, each an Envoy with
its own sidecar (``testing.gateways.Gateways``), in front of ONE simulator. They answer what
running the sidecar as several replicas costs, and what sharing the pool through Redis buys;
run them with e.g. ``python -m bench.compare --strategies
replicas-shared,replicas-full,replicas-split --loads 2``. Each replica's policy is the
``sidecar`` strategy's pool without the adaptive limit (the same buckets, priorities, shares,
deadlines and queue bounds; a static ``max_concurrency``; ``fail_fast`` off in all three,
because shared mode turns it off):

``replicas-shared``
    One pool of C shared by the replicas through a real ``redis-server`` started for the run
    (``pool.shared``, the lease 10 s scaled by the speedup).
``replicas-full``
    Each replica a pool of C and nothing shared: what operators get today when every replica
    is configured for the whole backend, 3C in all (the overshoot).
``replicas-split``
    Each replica a pool of C / 3 (the remainder to the first ones, so they add up to C) and
    nothing shared: no overshoot, but a replica refuses while another has idle slots.
``replicas-shared-fair``
    ``replicas-shared`` with ``sidecar-fair``'s tenants and fair order in every bucket: for
    the noisy-neighbour scenario across replicas (``--scenario noisy``, with ``--spread
    tenant`` for the uneven case; ``--replicas 1`` is its one-replica control).

The load generator spreads the requests over the three Envoy listeners round robin per
request, in arrival order, or with ``--spread tenant`` every request of a tenant to one of
them (:mod:`.spread`); a request's retries go back to the replica that answered it. Their
counters are summed over the replicas. Besides what every run reports,
:func:`.report.format_replicas` puts them side by side: goodput, SLO goodput, interactive p99
TTFT of first attempts and the backend's in-flight peak against C.

Every run, of every strategy, polls the simulators' ``/sim/stats`` every 0.5 s of wall time and
reports the most requests they ran at once (``num_requests_running``; the peak over the whole
run, and over the window, with the window's mean: :class:`.measure.InFlight`): what the backend
itself saw, whatever the admission layer thinks it admitted.

Clients are :mod:`bench.load`'s: interactive requests are streamed and give up after 30 s,
batch requests are not streamed and give up after 300 s, and by default they retry like the
OpenAI SDK (2 retries, Retry-After honoured). A request is *good* if its final answer is a
complete 200 within its class's timeout counted from the original arrival (retries included);
it meets its *SLO* if it is good and, when interactive, its first token came within 2 s of the
original arrival (:func:`.measure.meets_slo`). ``--mix long`` swaps the traces' lengths for
long prompts (~2.5k tokens) and ~300-token answers (up to 4k).

Capacity, honestly
------------------
Offered loads are multiples of the backend's capacity for *this* workload, which is computed, not
guessed: :func:`.capacity.closed_loop` runs the simulator's own scheduler core
(:class:`bench.sim.scheduler.Scheduler`, the code the server runs, minus the clock and the
sockets) over the workload's length mix, keeping exactly ``c`` requests in flight (a finished
request is replaced at once), and measures completions per simulated second between the 10th
and 90th percentile of completion times (warm-up and drain excluded).

* **capacity** = that throughput at ``c = max_num_seqs`` (the engine never has more running, so
  this is saturation: more offered load only adds waiting);
* **C**, the concurrency "the backend handles well", is the largest multiple of 8 at which the
  model still finishes 99 % of interactive requests within the client timeout *minus* the
  interactive queue deadline (a request admitted at its deadline still makes it) and 99 % of
  batch requests within theirs minus the batch deadline. Found by bisection (p99 latency grows
  with ``c``). envoy-cb, the priority gateway and sidecar-static get this same C; the
  adaptive sidecar only as its fallback.
* each class's own saturation throughput (req/s and tokens/s, that class alone at
  ``max_num_seqs``): the ``shift`` scenario floods one class at a time.

A short live saturation run (``--live-capacity-s``; ``max_num_seqs`` requests kept in flight
against the real simulator process at the chosen speedup) is printed next to the model's figure:
it shows whether this host can drive the simulator at that speedup.

Time and the measurement window
-------------------------------
Everything reported is in simulated seconds. The simulator and the load generator scale by
``--speedup`` themselves; Envoy, the gateway and the sidecar run on the wall clock, so their
deadlines and timers (queue timeouts, the pool's scrape interval and windows, the adaptive
filter's intervals) are written as ``simulated / speedup``; the pool's latency objectives are
compared with the simulator's histograms, which are simulated seconds, and are not scaled.
Retry-After is the exception: the sidecar computes it from wall-clock slot hold times and the
load generator reads it as simulated seconds, so at speedup S the adaptive part of Retry-After
is S times too short in simulated time (the 1 s floor and 60 s ceiling are left unscaled, so
they are right). Clients therefore come back sooner than the sidecar asked: more retry pressure,
never less.

Arrivals run for ``--duration`` (+1 s, default 200 s in every scenario); the run is then cut.
Everything is measured over the steady-state window ``[--warmup, --duration)``: a request counts
in it if its *final* outcome (last byte, last refusal, or giving up) falls inside. Goodput is
the rate of good outcomes in the window, so work queued during the run and drained after it
cannot inflate it (counting good answers per second of *arrivals* would, by up to the drain time
over the window). The default warm-up, (retries + 1) x the interactive timeout = 90 s, is the
longest an interactive request takes to end, so the interactive outcome mix is in steady state
inside the window. Batch requests may take 3 x 300 s: their queues (in the simulator for
``direct``, in the sidecar) are still filling at the end of a few-minute run, so batch figures
there are those of a system heading into overload, not of its steady state (see
docs/benchmarks.md).

Wasted work is read from the simulator's ``/sim/stats``: tokens generated for requests that were
aborted because their client disconnected (gave up), as a share of all tokens generated, from
the start of the run to the end of the window (a request's tokens count as aborted only when it
ends). Counters (simulator, sidecar, Envoy) are snapshotted at the start, at the window's start
and at its end while the load runs.

Health of the harness: two cores run the simulator, Envoy, the sidecar and the load generator.
Every run reports the simulator's engine lag (how late step results reached the sockets) and the
load generator's send lag; a run where either exceeds ``--max-lag-s`` is flagged, because its
latencies include the host's, not only the backend's.

During each run the backend (``/sim/stats``), the sidecar's ``llm_extproc_pool_limit`` gauge
and Envoy's adaptive ``concurrency_limit`` gauge are sampled every ``--sample-every`` simulated
seconds (:class:`.measure.Sample`); the scenarios' figures (recovery after a burst, a slowdown
or a spike; how fast the pool limit settles; how much idle capacity batch uses) come from those
samples and the per-request records (:mod:`.measure`). The targets are in :mod:`.report`.

Outputs (``--out``, default ``bench/results/``): ``compare.json`` (settings, capacity, every
strategy's configuration, per-run summaries, target checks), ``records.json`` (per-request
outcomes), ``timelines.json`` (the samples), ``goodput.png`` (steady: goodput, SLO goodput and
interactive p99 TTFT vs offered load per strategy), ``latency_cdf.png`` (steady: per class and
load, the fraction of requests answered within t), ``timeline_<scenario>.png`` (the others:
p99 TTFT in 10 s windows, requests running, the limit, over time).

Length: the default (steady, 4 loads, 7 strategies) is 28 runs of about 72 s at speedup 3,
about 35 minutes; each other scenario adds 7 runs (about 9 minutes); ``--quick`` halves every
length. A replica strategy's run takes a few seconds longer (three gateways to start), and
runs three Envoys and three sidecars on the same two cores: check the lag column.

Modules: :mod:`.options` (the options, the simulator's command line), :mod:`.capacity` (the
closed-loop model, C, the live check), :mod:`.scenarios` (each run's rates and events, pure),
:mod:`.baselines` (the peers and their configurations), :mod:`.strategies` (the sidecar's
policies, as data), :mod:`.deploy` (each strategy's processes), :mod:`.spread` (one schedule
over several gateways), :mod:`.run` (one strategy on one run: counters, samples, the in-flight
polls, speed changes), then the figures in two layers: :mod:`.slo` (the window and the SLO),
:mod:`.measure` (raw results to one record of figures per run, pure; per tenant:
:mod:`.tenants`) and :mod:`.report` (tables, targets PASS/MISS; the noisy neighbour's:
:mod:`.noisy`) with :mod:`.plots`; ``__main__`` (the whole comparison, the CLI).
"""
