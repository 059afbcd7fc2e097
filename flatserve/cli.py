"""The `flatserve` command: `serve` (engines + API server), `run-batch` (a batch file through
the same API and engines, offline), `plan` (the memory plan `serve` would state, without
starting it), `engine` (one engine alone),
`keys` (CURVE keys for remote engines), `soak` (RSS soak test), `bench` (serving benchmark),
`make-model` (the tiny default checkpoint)."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields, replace
from typing import NoReturn

from api_proc.config import ApiConfig
from flatserve.launcher import DEFAULT_MAX_ENGINE_RESTARTS, ENGINE_FLAGS
from flatserve.vllm_flags import add_vllm_flags
from shared.config_args import add_dataclass_args
from shared.engine_config import EngineConfig
from shared.memory_plan import parse_size


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--engines", type=int, default=1,
                       help="engine processes to spawn, all on --device (each takes a share of "
                       "a CPU's cores; with --tensor-parallel-size N on GPUs, engine e from "
                       "cuda:e*N)")
    group.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                       help="vLLM's data parallelism: this many engines, each on devices of its "
                       "own on GPUs (engine e from cuda:e*tp), as --engines on a CPU")
    group.add_argument("--engine-start-timeout", type=float, default=600.0,
                       help="seconds each engine may take to load and report ready")
    group.add_argument("--max-engine-restarts", type=int, default=None,
                       help="an engine that dies is spawned again (its requests fail once), "
                       "after a backoff that doubles from 0.5 s; this many failed tries in a "
                       "row and the server exits with code 1 (0: never restarted; default "
                       f"{DEFAULT_MAX_ENGINE_RESTARTS})")
    _add_engine_config_args(group, ENGINE_FLAGS)
    _add_short_tp_flag(group)


def _add_short_tp_flag(parser) -> None:
    """vLLM's short form of --tensor-parallel-size."""
    parser.add_argument("-tp", dest="tensor_parallel_size", type=int, default=argparse.SUPPRESS,
                        help="same as --tensor-parallel-size")


def _add_engine_config_args(parser, names) -> None:
    add_dataclass_args(parser, EngineConfig, names)


def run_engine(args: argparse.Namespace) -> int:
    """A standalone engine that an API server on another host reaches over tcp://."""
    from engine_proc.main import main as engine_main

    names = [f.name for f in fields(EngineConfig)]
    try:  # before the model loads: one line
        config = EngineConfig(**{n: getattr(args, n) for n in names if n != "log_level"},
                              log_level=args.log_level)
    except ValueError as e:
        print(f"flatserve engine: {e}", file=sys.stderr)
        return 2
    if not config.model:
        from shared.random_checkpoints import ensure_tiny_checkpoint

        config = replace(config, model=str(ensure_tiny_checkpoint()))
    if config.tensor_parallel_size > 1:
        from shared.model_config import load_model_config, tensor_parallel_problem

        problem = tensor_parallel_problem(load_model_config(config.model),
                                          config.tensor_parallel_size)
        if problem:
            print(f"flatserve engine: --tensor-parallel-size {config.tensor_parallel_size}: "
                  f"{problem}", file=sys.stderr)
            return 2
    return engine_main(["--config-json", config.to_json()])


def write_keys(args: argparse.Namespace) -> int:
    from rpc.curve import KeyFileError
    from rpc.curve import write_keys as write

    try:
        written = write(args.dir, force=args.force)
    except (KeyFileError, OSError) as e:
        print(f"flatserve keys: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


KEYS_HELP = """writes a server and a client CURVE key pair (zmq's certificate files) into DIR:

  server.key          the engine's public key        (the API host needs it)
  server.key_secret   the engine's key pair, 0600     (the engine host only)
  client.key          the API's public key
  client.key_secret   the API's key pair, 0600        (the API host only)
  authorized/         the API keys engines accept; holds a copy of client.key

the engine: flatserve engine --address tcp://0.0.0.0:5555 --curve-key-dir DIR
the API:    flatserve serve --engine-addresses tcp://HOST:5555 --curve-key-dir DIR
another API server: its own pair (flatserve keys --dir DIR2, then copy DIR/server.key
over DIR2/server.key), and DIR2/client.key copied into the engine's DIR/authorized/
under any name ending in .key; engines read authorized/ when they start"""


LOG_LEVELS = ["debug", "info", "warning", "error", "critical"]


def build_serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.add_argument("model_tag", nargs="?", metavar="MODEL",
                        help="local checkpoint folder, as `vllm serve MODEL` (same as --model)")
    ApiConfig.add_cli_args(parser)
    _add_engine_args(parser)
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    parser.add_argument("--host-memory-limit", type=parse_size, default=None, metavar="SIZE",
                        help="host memory all of this server's processes may use together "
                        "(bytes, or 24G: GiB, 24g: 10^9); the server refuses to start when the "
                        "sum of their memory plans is above it (default: the cgroup's memory "
                        "limit, if any)")
    parser.add_argument("--disable-log-requests", dest="enable_log_requests",
                        action="store_false", help="vLLM's older spelling of "
                        "--no-enable-log-requests")
    parser.add_argument("--uvicorn-log-level", choices=[*LOG_LEVELS, "trace"],
                        help="log level of the HTTP server (default: --log-level)")
    parser.add_argument("--disable-uvicorn-access-log", action="store_true",
                        help="no access log line per HTTP request")
    add_vllm_flags(parser)
    return parser


def serve(args: argparse.Namespace) -> NoReturn:
    from flatserve.launcher import run_server
    from shared.process import exit_without_teardown

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s api %(levelname)s %(name)s: %(message)s")
    code = run_server(args)
    # engines, sockets and the server are stopped: the API's module teardown is 0.2 s more
    exit_without_teardown(code)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flatserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    build_serve_parser(sub.add_parser("serve", help="spawn engines and serve the OpenAI-compatible API"))
    batch = build_serve_parser(sub.add_parser(
        "run-batch", help="run an OpenAI batch file (JSONL) through the engines and write the "
        "results (vLLM's run-batch)"))
    from flatserve.run_batch_args import add_run_batch_args

    add_run_batch_args(batch)
    build_serve_parser(sub.add_parser(
        "plan", help="print the memory plan `serve` would state with the same flags, "
        "without loading the model (exit 1 when it is above the memory limit)"))
    sub.add_parser("soak", help="RSS soak test (options: flatserve soak --help)", add_help=False)
    sub.add_parser("bench", help="serving benchmark (options: flatserve bench --help)",
                   add_help=False)
    engine = sub.add_parser("engine", help="run one engine process serving RPC on --address",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_engine_config_args(engine, [f.name for f in fields(EngineConfig) if f.name != "log_level"])
    _add_short_tp_flag(engine)
    engine.add_argument("--log-level", default="info")
    keys = sub.add_parser("keys", help="write CURVE keys for engines on other hosts",
                          description=KEYS_HELP,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    keys.add_argument("--dir", required=True, help="the key folder (created, mode 0700)")
    keys.add_argument("--force", action="store_true", help="replace keys already there")
    from shared.random_checkpoints import PRESETS

    make = sub.add_parser("make-model", help="write a random-weight checkpoint and print its folder")
    make.add_argument("--preset", choices=list(PRESETS), default="tiny",
                      help="tiny: the default model (Qwen2.5-VL); tiny-qwen2-vl, tiny-qwen3-vl, "
                      "tiny-qwen3-vl-moe: tiny models of the other families; "
                      "3b, 7b: Qwen2.5-VL-3B/7B shapes, bf16")
    make.add_argument("--out", help="write a fresh copy into this folder instead of the cache")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["soak"]:
        from flatserve.soak import main as soak_main

        return soak_main(argv[1:], prog="flatserve soak")
    if argv[:1] == ["bench"]:
        from flatserve.bench import main as bench_main

        return bench_main(argv[1:], prog="flatserve bench")
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "run-batch":
        from flatserve.run_batch import run_batch

        logging.basicConfig(level=args.log_level.upper(),
                            format="%(asctime)s run-batch %(levelname)s %(name)s: %(message)s")
        return run_batch(args)
    if args.command == "plan":
        from flatserve.plan import run_plan

        logging.basicConfig(level="WARNING")
        return run_plan(args)
    if args.command == "engine":
        return run_engine(args)
    if args.command == "keys":
        return write_keys(args)
    from shared.random_checkpoints import ensure_checkpoint, write_checkpoint

    preset = PRESETS[args.preset]
    print(write_checkpoint(args.out, preset) if args.out else ensure_checkpoint(preset))
    return 0


if __name__ == "__main__":
    sys.exit(main())
