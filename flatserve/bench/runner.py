"""One benchmark run end to end (`run_bench`) and the command line around it (`main`)."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from flatserve.bench.config import BenchConfig, parse_args
from flatserve.bench.health import HealthPoller, ServerUnreachable, health_path
from flatserve.bench.load import Load
from flatserve.bench.report import (
    format_comparison,
    format_rounds,
    format_table,
    write_json,
    write_rounds_json,
)
from flatserve.bench.request import RequestResult
from flatserve.bench.server_cpu import ServerCpu
from flatserve.bench.stats import BenchResult, summarize
from flatserve.bench.workload import build_units
from flatserve.soak.config import passthrough_value
from flatserve.soak.server import (
    ManagedServer,
    NoModelId,
    ServerStartError,
    first_model,
    run_interruptible,
    sigterm_as_interrupt,
)


class BenchError(RuntimeError):
    """The run could not be set up (server unreachable, no model...)."""


def _log(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


class _ProgressBar:
    """`with _ProgressBar(config):` a tqdm bar over the measured requests finished, with the
    errors so far; made on entry, so that its clock starts with the measured run."""

    def __init__(self, config: BenchConfig):
        self.config = config
        self.errors = 0

    def __enter__(self) -> _ProgressBar:
        from tqdm import tqdm

        self.bar = tqdm(total=self.config.num_requests, unit="req", desc="bench",
                        file=sys.stderr, disable=not self.config.progress, dynamic_ncols=True)
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()

    def update(self, result: RequestResult) -> None:
        if not result.ok:
            self.errors += 1
            self.bar.set_postfix(errors=self.errors, refresh=False)
        self.bar.update(1)


@contextlib.contextmanager
def _measuring(progress: _ProgressBar, poller: HealthPoller, cpu: ServerCpu
               ) -> Iterator[None]:
    with progress, poller, cpu:
        yield


def _report_warmup(results: list[RequestResult]) -> None:
    failed = [r for r in results if not r.ok]
    if failed:
        _log(f"{len(failed)} of {len(results)} warm-up requests failed; first: {failed[0].error}")


def _start_server(config: BenchConfig, stack: contextlib.ExitStack) -> tuple[str, dict]:
    """Start flatserve (or --server-command) and return its URL and the headers it needs."""
    server = ManagedServer(config, config.server_log_path())
    _log(f"starting {' '.join(server.command)} (log: {server.log_path})")
    stack.enter_context(server)
    return server.url, _bearer(config.api_key
                               or passthrough_value(config.server_args, "--api-key"))


@dataclass(frozen=True)
class Target:
    """One server under measurement, as found when attaching to it."""

    label: str | None
    base_url: str
    headers: dict[str, str]
    model: str
    health_path: str


def _attach(base_url: str, headers: dict[str, str], model: str | None,
            label: str | None) -> Target:
    try:
        path = health_path(base_url, headers)
    except ServerUnreachable as err:
        raise BenchError(str(err)) from None
    try:
        model = model or first_model(base_url, headers)
    except NoModelId as err:
        raise BenchError(str(err)) from None
    return Target(label, base_url, headers, model, path)


def _bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _main_target(config: BenchConfig, stack: contextlib.ExitStack) -> Target:
    """The server the run is about: started here, or the one at --base-url."""
    if config.base_url is None:
        base_url, headers = _start_server(config, stack)
    else:
        base_url, headers = config.base_url, _bearer(config.api_key)
    return _attach(base_url, headers, config.model, config.label)


def measure(config: BenchConfig, target: Target) -> BenchResult:
    """The warm-up and then the measured requests of `config` against `target`, polling its
    health during the measured part."""
    _log(f"model {target.model!r} at {target.base_url}, seed {config.seed}; timing GET "
         f"{target.health_path} every {config.health_interval_s:g} s during the run")
    units = build_units(config, target.model,
                        range(config.num_units + config.num_warmup_units))
    # the warm-up takes the last indices: its images differ from the measured ones
    measured, warmup = units[:config.num_units], units[config.num_units:]
    progress = _ProgressBar(config)
    load = Load(config, target.base_url + "/v1/chat/completions", target.headers,
                on_finish=progress.update)
    poller = HealthPoller(target.base_url + target.health_path, config.health_interval_s,
                          target.headers)
    cpu = ServerCpu(target.base_url)
    warm, results = run_interruptible(load.run(warmup, measured,
                                               _measuring(progress, poller, cpu)))
    _report_warmup(warm)
    settings = {"base_url": target.base_url, "model": target.model, **config.settings()}
    result = summarize(results, poller.latencies_s, target.health_path, poller.errors,
                       target.label, settings)
    result.server_cpu_us_per_token = cpu.per_token_us(result.output_tokens)
    return result


def run_bench(config: BenchConfig) -> BenchResult:
    """Start (or attach to) the server, send the warm-up and then the measured requests while
    polling its health, stop it, and return the figures. Raises ServerStartError or BenchError
    when the run cannot be set up. Not callable from inside a running event loop."""
    with contextlib.ExitStack() as stack:
        return measure(config, _main_target(config, stack))


def run_rounds(config: BenchConfig) -> list[tuple[BenchResult, BenchResult | None]]:
    """Per round, (this server's result, the peer's or None). Round r draws its requests from
    seed + r, the same for both servers (each sees each image once); the servers take turns
    going first, so that a drift of the machine's speed falls on both."""
    with contextlib.ExitStack() as stack:
        this = _main_target(config, stack)
        if this.label is None:
            this = dataclasses.replace(this, label="flatserve" if config.peer_url else None)
        peer = None if config.peer_url is None else _attach(
            config.peer_url, _bearer(config.peer_api_key), config.peer_model, config.peer_label)
        rounds = []
        for r in range(config.rounds):
            round_config = dataclasses.replace(config, seed=config.seed + r)
            if peer is None:
                rounds.append((measure(round_config, this), None))
                continue
            if r % 2 == 0:
                first = measure(round_config, this)
                rounds.append((first, measure(round_config, peer)))
            else:
                first = measure(round_config, peer)
                rounds.append((measure(round_config, this), first))
        return rounds


def run_with_baseline(config: BenchConfig) -> tuple[BenchResult | None, BenchResult]:
    """(the baseline's result or None, the run's result): with baseline_args, the same load
    first against a server started with them added, then against the one as given."""
    if not config.baseline_args:
        return None, run_bench(config)
    given = " ".join(config.server_args) or "defaults"
    baseline = config.with_server_args(config.baseline_args, " ".join(config.baseline_args))
    if config.server_log:  # the baseline server's log beside the other's, not over it
        log = Path(config.server_log)
        baseline = dataclasses.replace(baseline, server_log=str(log.with_stem(log.stem + "-baseline")))
    baseline = run_bench(baseline)
    return baseline, run_bench(config.with_server_args((), config.label or given))


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """The bench command line: 0 the run completed (errors are printed), 1 every request
    failed, 2 could not run, 130 interrupted."""
    try:
        config = parse_args(sys.argv[1:] if argv is None else argv, prog)
    except SystemExit as exit_:  # --help, or bad arguments (already reported)
        return exit_.code if isinstance(exit_.code, int) else 2
    rounds = config.peer_url is not None or config.rounds > 1
    try:
        with sigterm_as_interrupt():
            if rounds:
                return _print_rounds(config, run_rounds(config))
            baseline, result = run_with_baseline(config)
    except (ServerStartError, BenchError) as err:
        _log(str(err))
        return 2
    except KeyboardInterrupt:
        _log("interrupted")
        return 130
    if baseline is not None:
        print(format_table(baseline), end="\n\n")
    print(format_table(result))
    if baseline is not None:
        print("\n" + format_comparison(baseline, result))
    if config.json_path:
        write_json(config.json_path, result, baseline)
        print(f"wrote {config.json_path}")
    return 0 if result.completed and (baseline is None or baseline.completed) else 1


def _print_rounds(config: BenchConfig, rounds: list[tuple[BenchResult, BenchResult | None]]
                  ) -> int:
    for r, results in enumerate(rounds):
        print(f"---- round {r + 1} of {len(rounds)}, seed {config.seed + r} ----")
        for result in results:
            if result is not None:
                print(format_table(result), end="\n\n")
    if config.peer_url is not None:
        print(format_rounds(rounds))
    if config.json_path:
        write_rounds_json(config.json_path, rounds)
        print(f"wrote {config.json_path}")
    return 0 if all(result.completed for results in rounds for result in results
                    if result is not None) else 1
