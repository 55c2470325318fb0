"""The targets (PASS / MISS) and the printed report of one run's figures."""

from __future__ import annotations

from typing import Any

from bench.common.table import fmt, format_table
from bench.micro.admission_cost import LEVELS, format_costs
from bench.micro.tenant_cost import POPULATIONS, format_tenant_costs
from bench.overhead.profile import PROFILED
from bench.overhead.ways import FLOOR, NAIVE, SIDECAR, SIDECAR_REDIS, SIDECAR_RW

__all__ = ["report", "targets"]


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per target: what it asks, what was measured, PASS / MISS (n/a: not measured)."""
    rows: list[dict[str, Any]] = []

    def add(target: str, measured: str, ok: bool | None) -> None:
        rows.append(
            {
                "target": target,
                "measured": measured,
                "verdict": "n/a" if ok is None else ("PASS" if ok else "MISS"),
            }
        )

    o500 = res.get("open_loop", {}).get("500")
    closed = res.get("closed_loop", {})
    if o500:
        f = o500[FLOOR]
        for w in (SIDECAR, SIDECAR_RW, SIDECAR_REDIS):
            if w not in o500:
                continue
            a50, a99 = o500[w]["p50_ms"] - f["p50_ms"], o500[w]["p99_ms"] - f["p99_ms"]
            local = ""
            if w == SIDECAR_REDIS:
                r50 = o500[w]["p50_ms"] - o500[SIDECAR]["p50_ms"]
                r99 = o500[w]["p99_ms"] - o500[SIDECAR]["p99_ms"]
                local = f" (Redis over local: {r50:+.2f} ms / {r99:+.2f} ms)"
            add(
                f"added latency at 500 req/s ({w}): p50 <= 0.5 ms, p99 <= 2 ms",
                f"+{a50:.2f} ms / +{a99:.2f} ms{local}",
                a50 <= 0.5 and a99 <= 2.0,
            )
        n50, s50 = o500[NAIVE]["p50_ms"] - f["p50_ms"], o500[SIDECAR]["p50_ms"] - f["p50_ms"]
        n99, s99 = o500[NAIVE]["p99_ms"] - f["p99_ms"], o500[SIDECAR]["p99_ms"] - f["p99_ms"]
        add(
            "sidecar at least as fast as naive: added latency at 500 req/s",
            f"p50 +{s50:.2f} vs +{n50:.2f} ms, p99 +{s99:.2f} vs +{n99:.2f} ms",
            s50 <= n50 and s99 <= n99,
        )
    else:
        add("added latency at 500 req/s", "500 req/s not measured", None)
    if closed:
        s, n = closed[SIDECAR]["rate"], closed[NAIVE]["rate"]
        add(
            "sidecar at least as fast as naive: max rate (closed loop)",
            f"{s:,.0f} vs {n:,.0f} req/s",
            s >= n,
        )
        add(
            ">= 3,000 req/s through one sidecar process",
            f"{s:,.0f} req/s (rw: {closed[SIDECAR_RW]['rate']:,.0f})",
            s >= 3000,
        )
        cpu = {"closed loop": closed[SIDECAR]["server_cpu_us"]}
        for rate in ("500", "1000"):
            if rate in res.get("open_loop", {}):
                cpu[f"{rate} req/s"] = res["open_loop"][rate][SIDECAR]["server_cpu_us"]
        worst = max(cpu.values())
        add(
            "<= 150 us sidecar CPU per request (worst of 500, 1000 req/s, closed loop)",
            ", ".join(f"{v:.0f} us at {k}" for k, v in cpu.items()),
            worst <= 150,
        )
    held = res.get("held")
    if held:
        h = held["paced"]
        q, rss = h["queued"], h["sidecar_rss_mb"]
        add(
            f"{held['n']:,} queued requests held, sidecar RSS < 300 MB",
            f"{q:,} held, {rss:.0f} MB",
            q >= held["n"] and rss < 300,
        )
    gate = res.get("gate")
    if gate:
        worst_ratio, parts = 0.0, []
        for op in ("admit", "evict", "enter", "cancel"):
            lo, hi = gate["10"][op]["p50_us"], gate["10000"][op]["p50_us"]
            ratio = hi / lo if lo else float("inf")
            # 0.5 us of slack: below that, a ratio measures the clock, not the algorithm.
            worst_ratio = max(worst_ratio, ratio if hi - lo > 0.5 else 1.0)
            parts.append(f"{op} {lo:.1f}->{hi:.1f} us")
        add(
            "admit/evict cost independent of queue length (p50 at 10k <= 1.5x p50 at 10)",
            ", ".join(parts),
            worst_ratio <= 1.5,
        )
    tenants = res.get("tenants")
    if tenants:
        one, many, fresh = (tenants[p]["request"]["p50_us"] for p in POPULATIONS)
        ratio = many / one if one else float("inf")
        add(
            "per-request admission cost with 10,000 tenants tracked within 10% of one tenant "
            "(p50, enter + admit)",
            f"{one:.2f} -> {many:.2f} us ({ratio:.2f}x; fresh keys {fresh:.2f} us)",
            ratio <= 1.1,
        )
    return rows


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b <= 0:
        return "-"
    return f"{a / b:.2f}x"


def _signed(x: float) -> str:
    return "-" if x != x else f"{x:+.2f}"


def _header(res: dict[str, Any]) -> list[str]:
    env = res.get("env", {})
    cfg = res["config"]
    idle = res.get("idle_cpu_pct", {})
    other = res.get("other_cores_at_start", 0.0)
    return [
        f"llm-extproc overhead: {env.get('commit', '?')}, {env.get('cpus', '?')} CPUs, "
        f"Envoy {env.get('envoy', '?')}, Python {env.get('python', '?')}, "
        f"grpcio {env.get('grpcio', '?')}, protobuf {env.get('protobuf', '?')}",
        f"body {cfg['body_bytes']} B (rw: {cfg['body_bytes_rw']} B, no max_tokens); backend: "
        "Envoy direct_response; Envoy --concurrency 1",
        "idle CPU before load: "
        + ", ".join(f"{k} {v:.1f}%" for k, v in idle.items())
        + f"; other load on the machine: {other:.2f} cores"
        + ("  (NOT QUIET: figures are disturbed)" if other > 0.1 else ""),
    ]


def _open_loop(rate: str, ways: dict[str, dict[str, Any]]) -> list[str]:
    out = [
        "",
        f"open loop, {rate} req/s (HTTP/1.1, fixed schedule; latency = send to last byte; "
        f"+ = minus the floor's; srv of {SIDECAR_REDIS}: its sidecar and the redis-server)",
    ]
    f = ways[FLOOR]
    rows, failed = [], []
    for w, r in ways.items():
        rows.append(
            [
                w,
                str(r["ok"]),
                fmt(r["p50_ms"], 3),
                fmt(r["p99_ms"], 3),
                fmt(r["max_ms"]),
                _signed(r["p50_ms"] - f["p50_ms"]),
                _signed(r["p99_ms"] - f["p99_ms"]),
                fmt(r["server_cpu_us"], 0),
                fmt(r["server_cores"]),
                fmt(r["envoy_cpu_us"], 0),
                fmt(r["lag_p99_ms"]),
                fmt(r["generator_cores"]),
                fmt(r["other_cores"]),
            ]
        )
        if r["requests"] > r["ok"]:
            failed.append(f"  {w}: {r['requests'] - r['ok']} FAILED {r['statuses']}")
    headers = ["way", "ok", "p50 ms", "p99 ms", "max ms", "+p50", "+p99", "srv us/req"]
    headers += ["srv cores", "envoy us/req", "lag p99 ms", "gen cores", "other cores"]
    out.append(format_table(headers, rows))
    out += failed
    n = ways[NAIVE]
    for w in (SIDECAR, SIDECAR_RW, SIDECAR_REDIS):
        if w not in ways:
            continue
        s = ways[w]
        a50 = _ratio(s["p50_ms"] - f["p50_ms"], n["p50_ms"] - f["p50_ms"])
        a99 = _ratio(s["p99_ms"] - f["p99_ms"], n["p99_ms"] - f["p99_ms"])
        out.append(
            f"  {w}: p50 {s['p50_ms'] / f['p50_ms']:.1f}x floor's; added p50 {a50} naive's, "
            f"added p99 {a99} naive's; CPU/req "
            f"{_ratio(s['server_cpu_us'], n['server_cpu_us'])} naive's"
        )
    if SIDECAR_REDIS in ways and SIDECAR in ways:
        out.append("  " + _shared_vs_local(ways[SIDECAR_REDIS], ways[SIDECAR]))
    return out


def _shared_vs_local(shared: dict[str, Any], local: dict[str, Any]) -> str:
    """sidecar+redis against the local sidecar at one rate: what the shared pool adds."""
    calls = shared.get("redis_calls_per_request")
    redis_us = shared.get("redis_cpu_us")
    sidecar_us = (shared["server_cpu_us"] or 0.0) - (redis_us or 0.0)
    return (
        f"{SIDECAR_REDIS} over {SIDECAR} (shared pool through Redis vs local): p50 "
        f"{_signed(shared['p50_ms'] - local['p50_ms'])} ms, p99 "
        f"{_signed(shared['p99_ms'] - local['p99_ms'])} ms; Redis script calls per request "
        f"{fmt(calls, 3)}; CPU/req {fmt(shared['server_cpu_us'], 0)} us (sidecar "
        f"{sidecar_us:.0f} + redis-server {fmt(redis_us, 0)}) vs {fmt(local['server_cpu_us'], 0)}"
    )


def _closed_loop(cfg: dict[str, Any], closed: dict[str, dict[str, Any]]) -> list[str]:
    out = [
        "",
        f"closed loop (h2load, HTTP/1.1, {cfg['connections']} connections, "
        f"{cfg['closed_seconds']:g} s)",
    ]
    rows, failed = [], []
    for w, r in closed.items():
        rows.append(
            [
                w,
                f"{r['rate']:,.0f}",
                fmt(r["p50_ms"]),
                fmt(r["p99_ms"]),
                fmt(r["server_cpu_us"], 0),
                fmt(r["server_cores"]),
                fmt(r["envoy_cpu_us"], 0),
                fmt(r["envoy_cores"]),
                fmt(r["h2load_cores"]),
                fmt(r["other_cores"]),
            ]
        )
        if r["failed"] or r["non_2xx"]:
            failed.append(f"  {w}: {r['failed']} failed, {r['non_2xx']} non-2xx")
    headers = ["way", "req/s", "p50 ms", "p99 ms", "srv us/req", "srv cores", "envoy us/req"]
    headers += ["envoy cores", "h2load cores", "other cores"]
    out.append(format_table(headers, rows))
    out += failed
    f, n = closed[FLOOR], closed[NAIVE]
    for w in (NAIVE, SIDECAR, SIDECAR_RW, SIDECAR_REDIS):
        if w not in closed:
            continue
        s = closed[w]
        out.append(
            f"  {w}: {s['rate'] / f['rate']:.3f}x floor's rate, {s['rate'] / n['rate']:.2f}x "
            f"naive's; CPU/req {_ratio(s['server_cpu_us'], n['server_cpu_us'])} naive's"
        )
    return out


def _profile(prof: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for w in PROFILED:
        r = prof[w]
        out += [
            "",
            f"profile: py-spy, sidecar under closed loop ({w}); {r['samples']} samples "
            f"of running threads; {r['raw']}",
            "  threads: " + ", ".join(f"{k} {v:.0f}%" for k, v in r["threads"]),
            "  self time by category: " + ", ".join(f"{k} {v:.1f}%" for k, v in r["categories"]),
            "  our lines, self time (C calls they make included):",
            *(f"    {v:5.1f}%  {k}" for k, v in r["our_lines"][:10]),
            "  our functions, inclusive:",
            *(f"    {v:5.1f}%  {k}" for k, v in r["our_functions_inclusive"][:10]),
        ]
    return out


def _held(held: dict[str, Any]) -> list[str]:
    rest = held["rest"]
    out = [
        "",
        "held queue: one bucket, one slot held by a direct gRPC stream, requests through "
        f"Envoy (h2c); at rest: sidecar RSS {rest['sidecar_rss_mb']:.0f} MB, Envoy RSS "
        f"{rest['envoy_rss_mb']:.0f} MB",
    ]
    for kind in ("paced", "burst"):
        h = held.get(kind)
        if not h:
            continue
        how = f"at {h['rate']:g} req/s" if h["rate"] else "all at once"
        per_waiter_kb = 1024 * (h["sidecar_rss_mb"] - rest["sidecar_rss_mb"]) / max(1, h["queued"])
        out += [
            f"  {h['n']:,} sent {how} (h2load {h['h2load']}): {h['queued']:,} queued after "
            f"{h['fill_s']:.1f} s; sidecar RSS {h['sidecar_rss_mb']:.0f} MB "
            f"({per_waiter_kb:.1f} KB per waiter), Envoy RSS {h['envoy_rss_mb']:.0f} MB",
            "    Envoy while held: "
            + ", ".join(f"{k} {v}" for k, v in h["envoy_while_held"].items()),
            f"    slot freed: {h['answered_2xx']:,} answered 200 in {h['drain_s']:.2f} s "
            f"({h['answered_2xx'] / max(h['drain_s'], 1e-9):,.0f} admissions/s, one slot), "
            f"{h['answered_other']:,} other answers; sidecar outcomes "
            + ", ".join(f"{k} {v}" for k, v in h["sidecar_outcomes"].items())
            + f"; RSS after: sidecar {h['after']['sidecar_rss_mb']:.0f} MB, Envoy "
            f"{h['after']['envoy_rss_mb']:.0f} MB",
        ]
    return out


def report(res: dict[str, Any]) -> str:
    """Every figure of a run (``__main__.run``'s result) as text."""
    out = _header(res)
    for rate, ways in res.get("open_loop", {}).items():
        out += _open_loop(rate, ways)
    if res.get("closed_loop"):
        out += _closed_loop(res["config"], res["closed_loop"])
    if res.get("profile"):
        out += _profile(res["profile"])
    if res.get("held"):
        out += _held(res["held"])
    for level, title in LEVELS.items():
        if res.get(level):
            out += ["", *format_costs(title, res[level])]
    if res.get("tenants"):
        out += ["", *format_tenant_costs(res["tenants"])]
    out += ["", "targets"]
    out += [f"  {t['verdict']:<4}  {t['target']}: {t['measured']}" for t in res.get("targets", [])]
    return "\n".join(out)
