"""`flatserve serve`: spawn the engine processes, wait until each is ready, serve HTTP in this
process, watch them, and stop them all on SIGINT/SIGTERM or when serving ends. `launch_api`
is the part `flatserve run-batch` shares: everything up to serving."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psutil

from api_proc.config import ApiConfig
from rpc.sockets import IpcDir
from shared.engine_config import EngineConfig
from shared.memory import (
    API_MALLOC_ENV,
    ENGINE_MALLOC_ENV,
    apply_malloc_settings,
    glibc_tuning_enabled,
)
from shared.memory_plan import MemoryPlan, format_table, memory_limit, over_limit_message
from shared.model_config import load_model_config, tensor_parallel_problem
from shared.process import set_process_title

if TYPE_CHECKING:
    from flatserve.engine_supervisor import EngineSupervisor

# The HTTP side's modules (FastAPI, the app, the engine client: ~1 s of imports here) are
# imported where they are used, once the engines are spawned: their start (torch's import,
# the model) goes on meanwhile instead of after.

logger = logging.getLogger(__name__)

# EngineConfig fields that `serve` exposes as flags; the rest are set by the launcher.
ENGINE_FLAGS = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_num_encoder_patches",
    "encoder_stage_patches",
    "decode_share",
    "block_size",
    "enable_prefix_caching",
    "num_kv_blocks",
    "kv_cache_memory_bytes",
    "gpu_memory_utilization",
    "max_waiting",
    "device",
    "dtype",
    "torch_threads",
    "engine_nice",
    "encoder_cache_bytes",
    "seed",
    "tensor_parallel_size",
    "mamba_ssm_cache_dtype",
    "mamba_cache_mode",
    "state_snapshot_bytes",
    "pack_weights",
    "enforce_eager",
    "cudagraph_mode",
    "cudagraph_capture_sizes",
    "max_cudagraph_capture_size",
)
DEFAULT_MAX_MODEL_LEN = 8192
DEFAULT_MAX_ENGINE_RESTARTS = 5


class EngineStartError(RuntimeError):
    pass


@dataclass
class SpawnedEngine:
    config: EngineConfig
    process: subprocess.Popen
    memory_plan: MemoryPlan | None = None  # the engine's, heard when it became ready

    @property
    def alive(self) -> bool:
        return self.process.poll() is None


def engine_env() -> dict[str, str]:
    env = dict(os.environ)
    if glibc_tuning_enabled():
        for key, value in ENGINE_MALLOC_ENV.items():
            env.setdefault(key, value)
    return env


def spawn_engine(config: EngineConfig) -> SpawnedEngine:
    command = [sys.executable, "-m", "engine_proc.main", "--config-json", config.to_json(),
               "--die-with-parent"]
    process = subprocess.Popen(command, env=engine_env(), start_new_session=False)
    return SpawnedEngine(config, process)


async def _wait_ready(handle: SpawnedEngine, deadline: float) -> None:
    from api_proc.engine_client import EngineConnection

    connection = EngineConnection(handle.config.address)
    connection.open()
    try:
        while time.monotonic() < deadline:
            if not handle.alive:
                raise EngineStartError(
                    f"engine {handle.config.rank} exited with code {handle.process.returncode} "
                    "while starting (see its log above)"
                )
            try:
                await connection.wait_ready(0.2)  # not bound yet, or still loading the model
                handle.memory_plan = connection.memory_plan  # came with the first answer
                return
            except TimeoutError:
                pass
        raise EngineStartError(f"engine {handle.config.rank} not ready after its start timeout")
    finally:
        await connection.close()


def wait_engines_ready(handles: list[SpawnedEngine],
                       timeout_s: float = 600.0) -> list[SpawnedEngine]:
    """Wait until each spawned engine answers `health`; on any failure stop them all."""
    deadline = time.monotonic() + timeout_s

    async def wait_all() -> None:
        await asyncio.gather(*(_wait_ready(h, deadline) for h in handles))

    try:
        asyncio.run(wait_all())
    except BaseException:
        stop_engines(handles)
        raise
    return handles


def restart_engine(dead: SpawnedEngine, timeout_s: float) -> SpawnedEngine:
    """A new engine with `dead`'s settings, ready; EngineStartError when it is not."""
    handle = spawn_engine(dead.config)
    try:
        asyncio.run(_wait_ready(handle, time.monotonic() + timeout_s))
    except BaseException:
        stop_engines([handle])
        raise
    return handle


def kill_engines(handles: list[SpawnedEngine]) -> None:
    for handle in handles:
        if handle.alive:
            handle.process.kill()


def stop_engines(handles: list[SpawnedEngine], grace_s: float = 10.0) -> None:
    """SIGTERM every engine, SIGKILL those still there after `grace_s`. A SIGINT or SIGTERM
    meanwhile (a second Ctrl-C) kills them at once: it never cuts the wait short and leaves
    an engine behind."""
    def escalate(signum, frame) -> None:
        logger.warning("%s while stopping: killing the engines", signal.Signals(signum).name)
        kill_engines(handles)

    previous = _set_stop_handlers(escalate)
    try:
        for handle in handles:
            if handle.alive:
                handle.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for handle in handles:
            try:
                handle.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("engine %d did not stop in %.0fs; killing it",
                               handle.config.rank, grace_s)
                handle.process.kill()
                handle.process.wait()
    finally:
        _set_stop_handlers(previous)


def _set_stop_handlers(handlers) -> dict | None:
    """Install `handlers` (one for both, or {signal: handler}) for SIGINT and SIGTERM; the
    ones they replace. Only the main thread may: elsewhere nothing changes (None)."""
    if handlers is None or threading.current_thread() is not threading.main_thread():
        return None
    if not isinstance(handlers, dict):
        handlers = {signal.SIGINT: handlers, signal.SIGTERM: handlers}
    return {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}


def _resolve_model(args: argparse.Namespace,
                   command: str = "serve") -> tuple[str, tuple[str, ...]]:
    """(checkpoint folder, served model names): the positional model (vLLM's form) or
    --model, else the tiny default."""
    tag = getattr(args, "model_tag", None)
    if tag and args.model and tag != args.model:
        raise SystemExit(f"flatserve {command}: the model is given twice: {tag} and --model "
                         f"{args.model}")
    model = tag or args.model
    names = tuple(args.served_model_name or ())
    if model:
        return model, names or (model,)
    from shared.random_checkpoints import ensure_tiny_checkpoint

    return str(ensure_tiny_checkpoint()), names or ("flatserve-tiny-qwen2.5-vl",)


def _on_gpu(device: str | None) -> bool:
    if device is not None:
        return device.startswith("cuda")
    import torch  # only asked when the flag is given

    return torch.cuda.is_available()


def _check_gpu_count(device: str | None, needed: int, command: str = "serve") -> None:
    import torch

    first = int(device.partition(":")[2] or 0) if device else 0
    have = torch.cuda.device_count()
    if first + needed > have:
        raise SystemExit(f"flatserve {command}: engines x --tensor-parallel-size needs {needed} "
                         f"GPUs from cuda:{first}; {have} are visible")


def _engine_device(engine_kwargs: dict, rank: int, tp: int, spread: bool) -> dict:
    """Engine `rank`'s settings: on GPUs, with tensor parallelism or `spread` (data
    parallelism), each engine takes the next `tp` devices (its rank 0 on the first, its
    workers on the ones after it)."""
    device = engine_kwargs["device"]
    if (tp == 1 and not spread) or not _on_gpu(device):
        return engine_kwargs
    first = int(device.partition(":")[2] or 0) if device else 0
    return {**engine_kwargs, "device": f"cuda:{first + rank * tp}"}


def memory_plans(config: ApiConfig, configs: list[EngineConfig],
                 handles: list[SpawnedEngine]) -> list[MemoryPlan]:
    """The API's plan, measured now (the app built, the tokenizer loaded), then each spawned
    engine's. Engines started elsewhere count with EngineConfig's default capacity in the
    API's plan; their own plans belong to their hosts."""
    from api_proc.memory_plan import EngineCapacity, api_plan

    capacities = [EngineCapacity.of(c) for c in configs]
    if not configs:
        capacities = [EngineCapacity.of(EngineConfig())] * len(config.engine_addresses)
    api = api_plan(config, capacities, psutil.Process().memory_info().rss)
    return [api, *(h.memory_plan for h in handles if h.memory_plan is not None)]


class Stopped(Exception):
    """A SIGINT or SIGTERM (raise_stopped) while a command starts or stops."""


def raise_stopped(signum, frame) -> None:
    raise Stopped(signal.Signals(signum).name)


class StartFailed(Exception):
    """Starting failed and the reason is logged: the command exits with `code`."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


@dataclass
class Launched:
    """The API app over ready engines. `supervisor` restarts engines that die; the caller
    starts it once it runs (its `is_stopping` and `give_up` are the caller's)."""

    config: ApiConfig
    app: Any  # FastAPI
    supervisor: EngineSupervisor | None


@contextlib.contextmanager
def launch_api(args: argparse.Namespace, command: str, *, is_stopping: Callable[[], bool],
               give_up: Callable[[str], None], **overrides: Any) -> Iterator[Launched]:
    """What `serve` and `run-batch` share: the flags checked (SystemExit with one line, or
    StartFailed, before any process starts), the engines spawned and ready, the app built on
    them and its memory plan held against the limit. On exit the supervisor and the engines
    stop and the socket folder goes, however the body ended. `overrides`: ApiConfig fields
    the command sets itself."""
    model, served_names = _resolve_model(args, command)
    # Unset, the context is the model's own capped at DEFAULT_MAX_MODEL_LEN: requests without
    # max_tokens get the rest of the context, and image requests reserve KV for all of it.
    try:
        model_config = load_model_config(model)
    except (OSError, ValueError, KeyError) as e:  # before any process starts: one line
        raise SystemExit(f"flatserve {command}: {model}: {e}") from None
    own = model_config.text.max_position_embeddings
    tp = args.tensor_parallel_size
    problem = ("it must be at least 1" if tp < 1
               else tensor_parallel_problem(model_config, tp) if tp > 1 else None)
    if problem:
        raise SystemExit(f"flatserve {command}: --tensor-parallel-size {tp}: {problem}")
    max_model_len = args.max_model_len or min(own, DEFAULT_MAX_MODEL_LEN)
    if args.gpu_memory_utilization is not None and not _on_gpu(args.device):
        raise SystemExit(f"flatserve {command}: --gpu-memory-utilization applies to GPUs and "
                         "the engines run on the CPU: set --kv-cache-memory-bytes instead")
    # --engine-addresses: engines started elsewhere (`flatserve engine`), none spawned here.
    dp = args.data_parallel_size
    if args.engine_addresses and (tp, dp, args.engines) != (1, 1, 1):
        raise SystemExit(f"flatserve {command}: with --engine-addresses no engine is spawned "
                         "here: give --tensor-parallel-size to each `flatserve engine`, and one "
                         "address per engine instead of --engines or --data-parallel-size")
    if dp < 1 or args.engines < 1:
        raise SystemExit(f"flatserve {command}: --engines and --data-parallel-size must be at "
                         "least 1")
    if dp > 1 and args.engines > 1:
        raise SystemExit(f"flatserve {command}: give --engines (all on --device) or "
                         "--data-parallel-size (a device each on GPUs), not both")
    num_spawned = 0 if args.engine_addresses else max(dp, args.engines)
    spread = dp > 1
    if (tp > 1 or spread) and num_spawned and _on_gpu(args.device):
        _check_gpu_count(args.device, num_spawned * tp, command)
    if args.engine_addresses and args.max_engine_restarts is not None:
        raise SystemExit(f"flatserve {command}: --max-engine-restarts applies to engines "
                         "spawned here, and with --engine-addresses none is")
    max_restarts = DEFAULT_MAX_ENGINE_RESTARTS if args.max_engine_restarts is None \
        else args.max_engine_restarts
    if max_restarts < 0:
        raise SystemExit(f"flatserve {command}: --max-engine-restarts must not be negative")
    ipc_dir = IpcDir(prefix="flatserve-")
    engine_kwargs = {name: getattr(args, name) for name in ENGINE_FLAGS}
    num_processes = num_spawned * tp  # each engine is tp processes, started by its rank 0
    if num_processes > 1 and not engine_kwargs["torch_threads"] and "OMP_NUM_THREADS" not in os.environ:
        # engines (and their ranks) on one host share its cores instead of each taking all
        engine_kwargs["torch_threads"] = max(1, len(os.sched_getaffinity(0)) // num_processes)
    configs = [
        EngineConfig(model=model, address=ipc_dir.address(f"engine{rank}"), rank=rank,
                     max_model_len=max_model_len, log_level=args.log_level,
                     mm_inflight_budget=args.mm_inflight_budget,
                     **_engine_device(engine_kwargs, rank, tp, spread))
        for rank in range(num_spawned)
    ]
    addresses = tuple(args.engine_addresses) or tuple(c.address for c in configs)
    handles: list[SpawnedEngine] = []
    supervisor = None
    try:
        try:  # before the engines spend their start-up on a server that cannot run
            config = ApiConfig.from_cli_args(
                args, model=model, served_model_name=served_names, max_model_len=max_model_len,
                engine_addresses=addresses, **overrides)
        except ValueError as exc:
            logger.error("flatserve %s: %s", command, exc)
            raise StartFailed(2) from None
        handles = [spawn_engine(c) for c in configs]
        from api_proc.app import build_app  # while the engines start
        from flatserve.engine_supervisor import EngineSupervisor

        try:
            wait_engines_ready(handles, timeout_s=args.engine_start_timeout)
        except EngineStartError as exc:
            logger.error("%s", exc)
            raise StartFailed(1) from None
        app = build_app(config, engine_processes=[h.process for h in handles])
        plans = memory_plans(config, configs, handles)
        logger.info("memory plan (each process's RSS ceiling):\n%s", format_table(plans))
        limit = memory_limit(args.host_memory_limit)
        problem = limit and over_limit_message(plans, *limit)
        if problem:
            logger.error("flatserve %s: %s", command, problem)
            raise StartFailed(1)
        app.state.metrics.api_plan = plans[0]
        if handles and max_restarts:
            supervisor = EngineSupervisor(
                handles, app.state.engine_client.engines,
                lambda dead: restart_engine(dead, args.engine_start_timeout), max_restarts,
                on_restart=app.state.metrics.engine_restarts.inc, is_stopping=is_stopping,
                give_up=give_up)
        yield Launched(config, app, supervisor)
    finally:
        try:
            if supervisor is not None:
                supervisor.stop()  # before the engines stop: none is restarted then
            stop_engines(handles)
        finally:
            ipc_dir.close()


def run_server(args: argparse.Namespace) -> int:
    import uvicorn

    from api_proc.drain import DrainingServer
    from api_proc.http_protocol import http_protocol

    set_process_title("flatserve: api")
    apply_malloc_settings(API_MALLOC_ENV)
    server = None

    def give_up(reason: str) -> None:
        server.should_exit = True  # the supervisor starts after the server exists

    # uvicorn re-raises the SIGINT/SIGTERM it caught once it has shut down; with these
    # handlers that lands in the `except` below, after launch_api has stopped the engines
    # and removed the socket files.
    signal.signal(signal.SIGTERM, raise_stopped)
    signal.signal(signal.SIGINT, raise_stopped)
    try:
        with launch_api(args, "serve", is_stopping=lambda: server.should_exit, give_up=give_up,
                        # vLLM's: the key from the environment when --api-key is not given
                        api_key=args.api_key if args.api_key is not None
                        else os.environ.get("VLLM_API_KEY") or None) as launched:
            config, app, supervisor = launched.config, launched.app, launched.supervisor
            where = (f"unix socket {config.uds}" if config.uds
                     else f"{config.scheme}://{config.host}:{config.port}")
            logger.info("serving %s on %s (glibc: %s)", ", ".join(config.served_model_name),
                        where, ", ".join(f"{k}={v}" for k, v in API_MALLOC_ENV.items()))
            server_config = uvicorn.Config(
                app, host=config.host, port=config.port, uds=config.uds, loop="uvloop",
                http=http_protocol(config),
                ssl_keyfile=config.ssl_keyfile, ssl_certfile=config.ssl_certfile,
                ssl_ca_certs=config.ssl_ca_certs, ssl_cert_reqs=config.ssl_cert_reqs,
                log_level=args.uvicorn_log_level or args.log_level,
                access_log=not args.disable_uvicorn_access_log)
            server = DrainingServer(server_config, app.state.engine_client.abort_all,
                                    config.shutdown_timeout_s)
            if supervisor is not None:
                supervisor.start()
            server.run()
            return 1 if supervisor is not None and supervisor.gave_up else 0
    except StartFailed as failed:
        return failed.code
    except Stopped as stop:
        logger.info("stopped by %s", stop)
        return 0
