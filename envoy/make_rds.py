"""Regenerate envoy/envoy-rds.yaml and envoy/routes/routes.yaml from envoy/envoy.yaml.

Run `make envoy-rds` (or `python envoy/make_rds.py`) after changing envoy/envoy.yaml;
tests/deploy/test_render.py fails while they differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from extproc.config.envoy import to_rds  # noqa: E402

BOOTSTRAP_HEAD = """\
# Generated from envoy/envoy.yaml by `make envoy-rds` (tests/deploy/test_render.py checks it is
# current): the same Envoy, with routes loaded from envoy/routes/routes.yaml (file-based RDS,
# watched). Run from the repository root: envoy -c envoy/envoy-rds.yaml
"""

ROUTES_HEAD = """\
# Routes of envoy/envoy-rds.yaml (generated from envoy/envoy.yaml by `make envoy-rds`).
# Change them live, atomically: write the new file in this directory, then move it over this
# one (Envoy watches the directory for moves):
#   cp new.yaml envoy/routes/.routes.tmp && mv envoy/routes/.routes.tmp envoy/routes/routes.yaml
# A file Envoy rejects is logged and counted (http.llm.rds.llm.update_rejected); the last good
# routes stay. Per-route policy: metadata.filter_metadata.llm_extproc with bucket,
# max_concurrency, max_queue, queue_timeout, max_prompt_tokens, max_output_tokens,
# default_max_tokens (the same schema as the policy file: protos/llm_extproc/v1/policy.proto).
"""


def generate() -> tuple[str, str]:
    static = yaml.safe_load((HERE / "envoy.yaml").read_text())
    bootstrap, routes = to_rds(static, "envoy/routes")
    return (
        BOOTSTRAP_HEAD + yaml.safe_dump(bootstrap, sort_keys=False),
        ROUTES_HEAD + yaml.safe_dump(routes, sort_keys=False),
    )


if __name__ == "__main__":
    bootstrap, routes = generate()
    (HERE / "envoy-rds.yaml").write_text(bootstrap)
    (HERE / "routes").mkdir(exist_ok=True)
    (HERE / "routes" / "routes.yaml").write_text(routes)
