"""One soak run end to end (`run_soak`) and the command line around it (`main`)."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path

from flatserve.soak.config import SoakConfig, parse_args, parse_bytes, passthrough_value
from flatserve.soak.images import ImagePool
from flatserve.soak.load import LoadGenerator, LoadStats
from flatserve.soak.processes import listening_pid, make_targets, tree_pids
from flatserve.soak.report import write_csv, write_json, write_plot
from flatserve.soak.sampler import MB, RssSampler
from flatserve.soak.server import (
    ManagedServer,
    NoModelId,
    ServerStartError,
    first_model,
    log_tail,
    run_interruptible,
    sigterm_as_interrupt,
)
from flatserve.soak.summary import Summary, format_table, summarize
from flatserve.soak.videos import VideoPool


class SoakError(RuntimeError):
    """The run could not be set up (no model, no process to sample, bad budget...)."""


def _log(message: str) -> None:
    print(f"soak: {message}", file=sys.stderr, flush=True)


def started_server_budget_mb(config: SoakConfig) -> float | None:
    """The in-flight budget a started server runs with: its --mm-inflight-budget, else
    flatserve's own default when the command is flatserve's."""
    value = passthrough_value(config.server_args, "--mm-inflight-budget")
    if value is not None:
        try:
            return parse_bytes(value) / MB
        except ValueError as err:
            raise SoakError(f"--mm-inflight-budget: {err}") from None
    if config.server_command:
        return None
    try:
        from api_proc.config import ApiConfig
    except ImportError:
        return None
    field = next((f for f in dataclasses.fields(ApiConfig) if f.name == "mm_inflight_budget"), None)
    return None if field is None else field.default / MB


def _sampled_pids(config: SoakConfig) -> list[int]:
    if config.pids:
        return list(config.pids)
    pid = listening_pid(config.url or "")
    if pid is None:
        raise SoakError(f"found no local process listening at {config.url}; pass --pid")
    return tree_pids(pid)


class _ProgressBar:
    """tqdm over requests finished, with the first process's latest RSS and the errors."""

    def __init__(self, config: SoakConfig, sampler: RssSampler | None = None):
        from tqdm import tqdm

        self.sampler = sampler
        self.bar = tqdm(total=config.requests, unit="req", disable=not config.progress,
                        file=sys.stderr, dynamic_ncols=True, desc="soak")
        self._postfix_at = 0.0

    def update(self, stats: LoadStats) -> None:
        self.bar.update(1)
        now = time.monotonic()
        if now - self._postfix_at < 0.5:
            return
        self._postfix_at = now
        latest = self.sampler.latest if self.sampler else None
        postfix = {"errors": stats.errors, "in_flight": stats.in_flight}
        if latest is not None and latest.rss_mb:
            role, rss = next(iter(latest.rss_mb.items()))
            postfix[f"{role}_MB"] = f"{rss:.0f}"
        self.bar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        self.bar.close()


def _run_load(load: LoadGenerator) -> bool:
    """Run the load to its end; True when Ctrl-C cut it short (results so far are kept)."""
    try:
        run_interruptible(load.run())
    except KeyboardInterrupt:
        return True
    return False


def run_soak(config: SoakConfig, on_sample: Callable[[RssSampler], None] | None = None) -> Summary:
    """Start (or attach to) the server, load it while sampling RSS, stop it, write the CSV,
    PNG and JSON into the output folder and return the summary. Raises ServerStartError or
    SoakError when the run cannot be set up. Not callable from inside a running event loop."""
    out_dir = config.out_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    budget_mb = config.budget_mb
    should_stop = None
    with contextlib.ExitStack() as stack:
        if config.url is None:
            server = ManagedServer(config, out_dir / "server.log")
            _log(f"starting {' '.join(server.command)} (log: {server.log_path})")
            stack.enter_context(server)
            url, pids, should_stop = server.url, tree_pids(server.pid), server.exit_reason
            if budget_mb is None:
                budget_mb = started_server_budget_mb(config)
            if not headers and (key := passthrough_value(config.server_args, "--api-key")):
                headers = {"Authorization": f"Bearer {key}"}
        else:
            url, pids = config.url, _sampled_pids(config)
        try:
            model = config.model or first_model(url, headers)
        except NoModelId as err:
            raise SoakError(str(err)) from None
        targets = make_targets(pids)
        _log(f"model {model!r} at {url}; sampling "
             + ", ".join(f"{t.role} (pid {t.pid})" for t in targets))

        pool = ImagePool(config.image_size, config.pool_size, config.seed)
        if config.workload == "video":
            pool = VideoPool(config.image_size, config.video_frames, seed=config.seed)
        progress = _ProgressBar(config)
        stack.callback(progress.close)
        load = LoadGenerator(config, url, model, pool, headers, on_finish=progress.update,
                             should_stop=should_stop)
        sampler = RssSampler(targets, load.counts, config.interval_s, config.uss_every,
                             metrics_url=url + "/metrics", headers=headers)
        stack.callback(sampler.close)
        progress.sampler = sampler
        for i in range(config.idle_samples):
            if i:
                time.sleep(min(config.interval_s, 0.5))
            sampler.sample("idle")
        sampler.start()
        try:
            interrupted = _run_load(load)
        finally:
            sampler.stop()
            progress.close()  # before the final lines are printed
        sampler.sample("final")
        if on_sample is not None:
            on_sample(sampler)
        if budget_mb is None and sampler.budget_bytes is not None:
            budget_mb = sampler.budget_bytes / MB
    # the server (if started here) is stopped now
    summary = summarize(
        sampler.samples,
        [(t.role, t.pid, t.gone) for t in targets],
        load.stats,
        max_slope=config.max_slope,
        warmup_share=config.warmup_share,
        budget_mb=budget_mb,
        interrupted=interrupted,
        config=config.to_dict(),
        plans_mb={role: nbytes / MB for role, nbytes in sampler.plan_bytes.items()},
    )
    summary.files = {"csv": str(out_dir / "samples.csv"), "png": str(out_dir / "rss.png"),
                     "json": str(out_dir / "summary.json")}
    if config.url is None:
        summary.files["server_log"] = str(out_dir / "server.log")
    write_csv(Path(summary.files["csv"]), sampler.samples)
    write_plot(Path(summary.files["png"]), sampler.samples, summary)
    write_json(summary.files["json"], summary)
    if config.json_path and config.json_path != "-":
        write_json(config.json_path, summary)
    return summary


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """The soak command line: 0 passed, 1 failed (growth or errors), 2 could not run,
    130 interrupted."""
    try:
        config = parse_args(sys.argv[1:] if argv is None else argv, prog)
    except SystemExit as exit_:  # --help, or bad arguments (already reported)
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        with sigterm_as_interrupt():  # the load ends, the server stops, results are kept
            summary = run_soak(config)
    except (ServerStartError, SoakError) as err:
        _log(str(err))
        return 2
    except KeyboardInterrupt:
        _log("interrupted")
        return 130
    table_stream = sys.stderr if config.json_path == "-" else sys.stdout
    print(format_table(summary), file=table_stream)
    if "server_log" in summary.files and (summary.stop_reason or any(
            p.exited for p in summary.processes)):
        print(f"last lines of {summary.files['server_log']}:\n"
              + log_tail(Path(summary.files["server_log"])), file=table_stream)
    print("wrote " + ", ".join(summary.files.values()), file=table_stream)
    if config.json_path == "-":
        write_json("-", summary)
    if summary.passed:
        return 0
    return 130 if summary.interrupted else 1
