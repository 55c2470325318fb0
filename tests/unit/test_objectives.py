"""The latency objectives' table (``extproc.objectives``): a new objective is one row,
and its two keys in the policy's ``Slo`` message; the policy, the scraper, the law, the band
cut and the gauges all pick it up with no other change.

The check runs in a fresh interpreter: the table (and the generated ``policy_pb2``, here
built from the real one with the row's two fields added, as ``make protos`` would) is replaced
before the rest of the sidecar is imported, exactly as an edited table would be read."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from extproc.objectives import OBJECTIVES
from extproc.pool.control.adaptive import LimitReason

TOY = r'''
import sys, types

from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.internal import builder

import extproc.objectives as objectives
from extproc._proto.llm_extproc.v1 import policy_pb2

# The one row.
TOY = objectives.Objective(
    name="e2e",
    family="vllm:e2e_request_latency_seconds",
    key="e2e",
    what="vLLM's end-to-end request latency",
    quantile=0.5,
)
objectives.OBJECTIVES = (*objectives.OBJECTIVES, TOY)

# Its two fields in Slo, as `make protos` would generate them (in a package of its own, so
# that the real messages stay registered).
FD = descriptor_pb2.FieldDescriptorProto
proto = descriptor_pb2.FileDescriptorProto.FromString(policy_pb2.DESCRIPTOR.serialized_pb)
proto.name, proto.package = "toy/policy.proto", "toy.v1"
for message in proto.message_type:
    for f in [*message.field, *(f for nested in message.nested_type for f in nested.field)]:
        if f.type_name.startswith(".llm_extproc.v1."):
            f.type_name = ".toy.v1." + f.type_name.removeprefix(".llm_extproc.v1.")
slo = next(m for m in proto.message_type if m.name == "Slo")
slo.field.add(name="e2e", number=10, label=FD.LABEL_OPTIONAL, type=FD.TYPE_MESSAGE,
              type_name=".google.protobuf.Duration")
slo.oneof_decl.add(name="_e2e_quantile")
slo.field.add(name="e2e_quantile", number=11, label=FD.LABEL_OPTIONAL, type=FD.TYPE_DOUBLE,
              oneof_index=len(slo.oneof_decl) - 1, proto3_optional=True)
pool = descriptor_pool.Default()
pool.AddSerializedFile(proto.SerializeToString())
generated = types.ModuleType(policy_pb2.__name__)
generated.DESCRIPTOR = pool.FindFileByName(proto.name)
builder.BuildMessageAndEnumDescriptors(generated.DESCRIPTOR, generated.__dict__)
builder.BuildTopDescriptorsAndMessages(generated.DESCRIPTOR, "toy_pb2", generated.__dict__)
sys.modules[policy_pb2.__name__] = generated
sys.modules["extproc._proto.llm_extproc.v1"].policy_pb2 = generated

# Nothing else changed: the rest of the sidecar, as it is.
import yaml

from extproc.backend.scrape import Latency, Scraper, Signals, parse_metrics
from extproc.config.policy import policy_from_yaml
from extproc.ops.metrics import POOL_GAUGES
from extproc.pool.control.adaptive import AdaptiveLimit, LimitReason
from extproc.pool.control.bandcut import BandLoad
from extproc.pool.control.poller import BackendSnapshot
from extproc.pool.view import render_debug, render_gauges

# The policy: its keys, its default quantile, the dump, which loads again.
text = """
pool: {adaptive: {initial: 100, slo: {ttft: 1s, e2e: 30s, e2e_quantile: 0.8}}}
backend: {metrics: [http://vllm:8000/metrics]}
buckets: [{name: a, queue_timeout: 1s}]
"""
policy = policy_from_yaml(text)
a = policy.pool.adaptive
assert a.slo_s == {"ttft": 1.0, "e2e": 30.0} and a.quantiles["e2e"] == 0.8, a
assert policy_from_yaml(text.replace(", e2e_quantile: 0.8", "")).pool.adaptive.quantiles[
    "e2e"] == 0.5
slo = policy.to_dict()["pool"]["adaptive"]["slo"]
assert slo == {"ttft": "1s", "ttft_quantile": 0.9, "e2e": "30s", "e2e_quantile": 0.8}, slo
assert policy_from_yaml(yaml.safe_dump(policy.to_dict())) == policy

# The scraper: its family read, windowed at its quantile.
page = "".join(
    f'vllm:e2e_request_latency_seconds_bucket{{le="{le}"}} {n}\n'
    for le, n in (("10", 0), ("60", 0), ("+Inf", 0))
)
assert parse_metrics(page).histograms == {"e2e": {10.0: 0.0, 60.0: 0.0, float("inf"): 0.0}}
scraper = Scraper.from_policy(policy.backend, a)
assert scraper.quantiles["e2e"] == 0.8
scraper._fold(0.0, {"vllm:1": parse_metrics(page)}, [])
grown = page.replace('"60"} 0', '"60"} 20').replace('"+Inf"} 0', '"+Inf"} 20')
signals = scraper._fold(1.0, {"vllm:1": parse_metrics(grown)}, [])
assert signals.latency["e2e"] == (10 + 50 * 0.8, 20), signals.latency

# The law: its breach cuts the limit, or first the least urgent band, by its name.
limit = AdaptiveLimit(a)
assert limit.update(1.0, signals, in_flight=100, waiting=5) == 60  # x 30 s / 50 s
assert limit.reason == "e2e" and limit.reason.is_latency and not limit.reason.moves_band
band = BandLoad(running=40, waiting=5, floor=0, top=40)
banded = AdaptiveLimit(a)
assert banded.update(1.0, signals, in_flight=100, waiting=5, band=band) == 100
assert banded.reason == LimitReason("band_e2e") and banded.reason.moves_band
assert banded.band_cut.cap == 24  # 40 x 0.6

# The gauges and the debug view.
help = "Windowed quantile of vLLM's end-to-end request latency (the SLO's)."
assert POOL_GAUGES["backend_e2e_seconds"] == help
gauges = {}
render_gauges(BackendSnapshot.of(signals), gauges)
assert gauges["backend_e2e_seconds"] == 50.0 and "backend_ttft_seconds" not in gauges, gauges
assert render_debug(BackendSnapshot.of(signals))["e2e_s"] == 50.0
print("picked up")
'''


def test_a_new_objective_is_one_row() -> None:
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", TOY], cwd=root, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout == "picked up\n", done.stderr


def test_the_table_names_each_objective_once() -> None:
    for field in ("name", "family", "key"):
        values = [getattr(o, field) for o in OBJECTIVES]
        assert len(set(values)) == len(values), field
    assert [o.name for o in OBJECTIVES] == ["ttft", "itl", "tpot", "queue_time"]


def test_the_limit_reasons_of_each_objective() -> None:
    """An objective's reasons, its name and band_<name>, are the enum's, the same strings."""
    for o in OBJECTIVES:
        cut, band = LimitReason(o.name), LimitReason(f"band_{o.name}")
        assert (cut, band) == (o.name, f"band_{o.name}")
        assert cut is LimitReason(o.name)  # one member each, made once
        assert (cut.is_latency, cut.moves_band, band.is_latency, band.moves_band) == (
            True,
            False,
            False,
            True,
        )
    assert LimitReason.LEND.moves_band and not LimitReason.KV.is_latency
    for unknown in ("band_kv", "band_band_ttft", "e2e"):
        try:
            LimitReason(unknown)
        except ValueError:
            continue
        raise AssertionError(unknown)
