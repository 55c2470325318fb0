"""``llm-extproc serve | check | render-envoy``; ``llm-extproc --version``.

``serve`` checks its flags before it starts anything, and a flag it cannot use (a malformed or
busy ``--listen`` or ``--metrics`` address, a TLS file it cannot read or load, an unknown
``--log-level``, a ``--policy`` file it cannot read or resolve) ends it with one line on stderr,
``llm-extproc serve: error: --FLAG: cause``, and exit status 2, as argparse's own usage errors.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import ssl
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

import yaml

from extproc import version
from extproc.app import ListenError, Sidecar, TlsFiles, default_policy, split_host_port
from extproc.config.policy import Policy, PolicyError, load_policy
from extproc.contract import MESSAGE_TIMEOUT_MARGIN_S
from extproc.ops.logs import configure as configure_logging

__all__ = ["main"]


def _policy(path: str | None) -> Policy:
    return load_policy(path) if path else default_policy()


def _deadline_problems(policy: Policy, envoy_path: str) -> list[str]:
    """The policy's queue deadlines that the Envoy config at ``envoy_path`` cannot honour."""
    from extproc.config.envoy import deadline_problems

    try:
        config = yaml.safe_load(Path(envoy_path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        return [f"cannot read the Envoy config {envoy_path}: {e}"]
    if not isinstance(config, dict):
        return [f"the Envoy config {envoy_path} is not a YAML mapping"]
    return deadline_problems(policy, config)


class FlagError(Exception):
    """A ``serve`` flag that cannot be used: ``flag`` and the cause, for one line on stderr."""

    def __init__(self, flag: str, cause: object) -> None:
        super().__init__(f"{flag}: {cause}")
        self.flag = flag


# The flag of each listener of ``extproc.app.ListenError``.
_LISTENER_FLAGS = {"listen": "--listen", "metrics": "--metrics"}


def _check_address(flag: str, value: str, *, unix: bool) -> None:
    """``value`` is HOST:PORT with a port 0-65535 (or, where ``unix``, ``unix:PATH``)."""
    if unix and value.startswith("unix:"):
        if not value.removeprefix("unix:").removeprefix("//"):
            raise FlagError(flag, f"{value!r} names no socket path")
        return
    try:
        port = split_host_port(value)[1]
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        shape = "HOST:PORT or unix:PATH" if unix else "HOST:PORT"
        raise FlagError(flag, f"{value!r} is not {shape} with a port from 0 to 65535")


def _check_log_level(value: str) -> None:
    if not isinstance(logging.getLevelName(value.upper()), int):
        raise FlagError(
            "--log-level", f"unknown level {value!r} (debug, info, warning, error or critical)"
        )


def _tls_files(args: argparse.Namespace) -> TlsFiles | None:
    """The TLS flags as ``TlsFiles``, each file read and loaded the way the listener will."""
    given = {
        "--tls-cert": args.tls_cert,
        "--tls-key": args.tls_key,
        "--tls-client-ca": args.tls_client_ca,
    }
    if not any(given.values()):
        return None
    if not (args.tls_cert and args.tls_key):
        missing = "--tls-key" if args.tls_cert else "--tls-cert"
        with_flags = " and ".join(flag for flag, path in given.items() if path)
        raise FlagError(missing, f"required with {with_flags}")
    for flag, path in given.items():
        if path:
            try:
                Path(path).read_bytes()
            except OSError as e:
                raise FlagError(flag, f"cannot read {path}: {e.strerror or e}") from None
    tls = TlsFiles(
        cert=Path(args.tls_cert),
        key=Path(args.tls_key),
        client_ca=Path(args.tls_client_ca) if args.tls_client_ca else None,
    )
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(tls.cert, tls.key)
    except ssl.SSLError as e:
        raise FlagError(
            "--tls-cert/--tls-key",
            f"not a PEM certificate and its private key ({e.reason or e})",
        ) from None
    if tls.client_ca is not None:
        try:
            ctx.load_verify_locations(tls.client_ca)
        except ssl.SSLError as e:
            raise FlagError("--tls-client-ca", f"no PEM CA certificate ({e.reason or e})") from None
    return tls


def _serving_policy(path: str | None) -> Policy:
    try:
        return _policy(path)
    except PolicyError as e:
        raise FlagError("--policy", e) from None


async def _serve(args: argparse.Namespace, policy: Policy, tls: TlsFiles | None) -> None:
    if args.envoy_config:
        for problem in _deadline_problems(policy, args.envoy_config):
            logging.getLogger("extproc").error("deadline cannot be honoured: %s", problem)
    sidecar = Sidecar(
        policy,
        listen=args.listen,
        metrics_listen=args.metrics or None,
        policy_path=args.policy,
        watch_interval_s=args.watch_interval,
        tls=tls,
    )
    await sidecar.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, sidecar.reload)
    await stop.wait()
    logging.getLogger("extproc").info("stopping")
    await sidecar.stop(grace=args.grace)


def _run(main: Coroutine[Any, Any, None], event_loop: str) -> None:
    """Run on uvloop when asked, or when installed and not refused ("auto")."""
    if event_loop in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if event_loop == "uvloop":
                main.close()
                raise FlagError("--event-loop", "uvloop is not installed") from None
        else:
            uvloop.run(main)
            return
    asyncio.run(main)


def _render(args: argparse.Namespace) -> int:
    from extproc.config.envoy import render, validate
    from extproc.config.policy import parse_duration

    try:
        policy = _policy(args.policy)
        route_wait = parse_duration(args.route_queue_timeout)
    except (PolicyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    rendered = render(
        policy,
        extproc_address=args.extproc_address,
        extproc_port=args.extproc_port,
        longest_route_queue_timeout_s=route_wait,
        sidecar_cluster=args.sidecar_cluster,
        backend_cluster=args.backend_cluster,
    )
    validate(rendered)
    print(f"# Envoy settings for policy {args.policy or '<embedded default>'}.")
    print("# http_filters go before envoy.filters.http.router in the HTTP connection manager,")
    print("# in this order; a filter that sets a trusted header (auth) goes right after the")
    print("# header strip (first), or the strip removes what it set;")
    print("# virtual_host goes on the route_config's virtual host of the LLM routes, and routes")
    print("# are its routes (cluster backend: your model server's), with no catch-all: Envoy")
    print("# answers 404 for any other path. llm_routes applies to each route through the")
    print("# sidecar, other_routes to each route that skips it (the pass-through allowlist).")
    print(yaml.safe_dump(rendered, sort_keys=False), end="")
    return 0


class _Version(argparse.Action):
    """``--version``: the version read only when asked (importlib.metadata is slow to load)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(
            option_strings,
            dest=argparse.SUPPRESS,
            default=argparse.SUPPRESS,
            nargs=0,
            help="print the version and exit",
        )

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(f"{parser.prog} {version()}")
        parser.exit()


def _serve_main(args: argparse.Namespace) -> int:
    """Check the flags, then serve until SIGTERM or SIGINT; 2 for a flag that cannot be
    used (one line on stderr), 1 for a policy the sidecar refused at start."""
    try:
        _check_address("--listen", args.listen, unix=True)
        if args.metrics:
            _check_address("--metrics", args.metrics, unix=False)
        _check_log_level(args.log_level)
        tls = _tls_files(args)
        policy = _serving_policy(args.policy)
        configure_logging(args.log_level, args.log_format)
        _run(_serve(args, policy, tls), args.event_loop)
    except ListenError as e:
        return _usage_error(FlagError(_LISTENER_FLAGS[e.listener], e))
    except FlagError as e:
        return _usage_error(e)
    except PolicyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


def _usage_error(e: FlagError) -> int:
    print(f"llm-extproc serve: error: {' '.join(str(e).split())}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llm-extproc", description=__doc__)
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the ext_proc sidecar")
    serve.add_argument("--policy", help="policy YAML (default: the embedded default policy)")
    serve.add_argument(
        "--listen", default="127.0.0.1:50051", help="gRPC address, HOST:PORT or unix:/path"
    )
    serve.add_argument(
        "--metrics", default="127.0.0.1:9464", help="metrics HOST:PORT ('' to disable)"
    )
    serve.add_argument(
        "--grace",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds admitted requests may take to finish",
    )
    serve.add_argument(
        "--watch-interval",
        type=float,
        default=1.0,
        help="seconds between checks of the policy file for changes (0: only on SIGHUP)",
    )
    serve.add_argument("--tls-cert", help="PEM certificate: serve gRPC over TLS")
    serve.add_argument("--tls-key", help="PEM private key of --tls-cert")
    serve.add_argument(
        "--tls-client-ca", help="PEM CA: require client certificates signed by it (mutual TLS)"
    )
    serve.add_argument(
        "--event-loop",
        choices=("auto", "asyncio", "uvloop"),
        default=os.environ.get("LLM_EXTPROC_EVENT_LOOP", "auto"),
        help="auto: uvloop when installed (default; env LLM_EXTPROC_EVENT_LOOP)",
    )
    serve.add_argument(
        "--envoy-config",
        help="the Envoy config in front (YAML): log an error for every queue deadline it "
        "cannot honour (see `check --envoy`)",
    )
    serve.add_argument(
        "--log-level", default="INFO", help="debug, info (default), warning, error or critical"
    )
    serve.add_argument("--log-format", choices=("json", "text"), default="json")

    check = sub.add_parser("check", help="validate a policy and print it resolved")
    check.add_argument("--policy", help="policy YAML (default: the embedded default policy)")
    check.add_argument(
        "--envoy",
        help="an Envoy config (bootstrap YAML) to check the policy's deadlines against; "
        "exit status 1 when one cannot be honoured",
    )

    render = sub.add_parser(
        "render-envoy", help="print the Envoy settings the policy needs (filters, cluster, ...)"
    )
    render.add_argument("--policy", help="policy YAML (default: the embedded default policy)")
    render.add_argument("--extproc-address", default="127.0.0.1")
    render.add_argument("--extproc-port", type=int, default=50051)
    render.add_argument(
        "--route-queue-timeout",
        default="0s",
        help="longest queue_timeout set in route metadata, if above the policy's",
    )
    render.add_argument(
        "--backend-cluster",
        default="backend",
        help="the model server's cluster, which the routes go to (default: backend)",
    )
    render.add_argument(
        "--sidecar-cluster",
        default="llm_extproc",
        help="this backend's sidecar cluster: with several backends, one each; the routes "
        "then send their ext_proc calls to it (docs/deploy.md, 'Several models')",
    )

    args = parser.parse_args(argv)
    if args.command == "render-envoy":
        return _render(args)
    if args.command == "check":
        try:
            policy = _policy(args.policy)
        except PolicyError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(yaml.safe_dump(policy.to_dict(), sort_keys=False), end="")
        need = policy.longest_queue_timeout_s + MESSAGE_TIMEOUT_MARGIN_S
        print(
            f"# Envoy's ext_proc max_message_timeout must be at least {need:g}s "
            "(the longest wait: queue_timeout, and a relegation's after it, + margin)."
        )
        if args.envoy:
            problems = _deadline_problems(policy, args.envoy)
            for problem in problems:
                print(f"error: deadline cannot be honoured: {problem}", file=sys.stderr)
            if problems:
                return 1
            print(f"# {args.envoy} honours every queue deadline of the policy.")
        return 0

    return _serve_main(args)


if __name__ == "__main__":
    sys.exit(main())
