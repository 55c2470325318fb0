"""``python -m bench.load``: the open-loop load generator from the command line (times in
simulated seconds); prints the summary table, optionally writes the result as JSON."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from .presets import MIXES, default_classes
from .runner import DEFAULT_MODEL, LoadConfig, run_load
from .summary import format_result
from .workload import DEFAULT_TRACES_DIR, class_from_dict


def parse_args(argv: list[str] | None) -> tuple[LoadConfig, argparse.Namespace]:
    """The run the flags describe, and the flags (for the output options)."""
    p = argparse.ArgumentParser(
        prog="python -m bench.load",
        description="Open-loop LLM load generator (times in simulated seconds).",
    )
    p.add_argument("--url", default="http://127.0.0.1:10000", help="base URL of the endpoint")
    p.add_argument(
        "--stats-url",
        default=None,
        help="simulator stats URL for wasted-work accounting, e.g. http://127.0.0.1:8000/sim/stats",
    )
    p.add_argument("--rate", type=float, default=5.0, help="total arrivals per simulated second")
    p.add_argument("--duration", type=float, default=60.0, help="arrival window, simulated seconds")
    p.add_argument("--max-requests", type=int, default=10_000)
    p.add_argument("--speedup", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--arrivals",
        choices=("poisson", "trace"),
        default="poisson",
        help="Poisson arrivals, or replay each class's trace scaled to its rate",
    )
    p.add_argument(
        "--interactive-share",
        type=float,
        default=0.8,
        help="share of the rate for the interactive class (rest: batch)",
    )
    p.add_argument(
        "--mix",
        choices=MIXES,
        default="default",
        help="lengths: the Azure traces (default) or long prompts (~2.5k) with ~300-token answers",
    )
    p.add_argument(
        "--classes",
        default=None,
        help="JSON list of class objects (ClassSpec fields), replaces the default mix; "
        "a path to a JSON file also works",
    )
    p.add_argument("--traces-dir", default=None, help=f"default {DEFAULT_TRACES_DIR}")
    p.add_argument(
        "--max-retries", type=int, default=0, help="OpenAI-SDK-style retries (SDK default 2)"
    )
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--prompt-tokens-header", action="store_true", help="send x-sim-prompt-tokens")
    p.add_argument(
        "--max-run", type=float, default=None, help="hard cap on the run, simulated seconds"
    )
    p.add_argument(
        "--json-out", default=None, help="write the result as JSON here ('-' for stdout)"
    )
    p.add_argument("--records", action="store_true", help="include per-request records in the JSON")
    args = p.parse_args(argv)
    if args.classes:
        raw = args.classes
        if not raw.lstrip().startswith("[") and Path(raw).exists():
            raw = Path(raw).read_text()
        classes = tuple(class_from_dict(d) for d in json.loads(raw))
    else:
        classes = default_classes(
            args.rate,
            interactive_share=args.interactive_share,
            arrivals=args.arrivals,
            mix=args.mix,
        )
    cfg = LoadConfig(
        url=args.url,
        classes=classes,
        duration_s=args.duration,
        max_requests=args.max_requests,
        speedup=args.speedup,
        seed=args.seed,
        max_retries=args.max_retries,
        stats_url=args.stats_url,
        traces_dir=args.traces_dir,
        model=args.model,
        prompt_tokens_header=args.prompt_tokens_header,
        max_run_s=args.max_run,
    )
    return cfg, args


def main(argv: list[str] | None = None) -> None:
    cfg, args = parse_args(argv)
    result = asyncio.run(run_load(cfg))
    print(format_result(result), file=sys.stderr if args.json_out == "-" else sys.stdout)
    if args.json_out:
        text = json.dumps(result.to_dict(include_records=args.records), indent=2)
        if args.json_out == "-":
            print(text)
        else:
            Path(args.json_out).write_text(text + "\n")


if __name__ == "__main__":
    main()
