"""`flatserve serve` states each process's memory plan at start, exports it in /metrics beside
the measured RSS, and refuses to start when the plans' sum is above the memory allowed."""

from __future__ import annotations

import subprocess
import sys

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.server_process import REPO, SMALL_ENGINE_FLAGS, ServerProcess, free_port


def plan_gauges(server) -> tuple[dict, dict, dict]:
    """(parts by (process, part), totals by process, RSS by process) from /metrics."""
    parts, totals, rss = {}, {}, {}
    text = httpx.get(server.url + "/metrics").text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "flatserve_memory_plan_bytes":
                parts[s.labels["process"], s.labels["part"]] = s.value
            elif s.name == "flatserve_memory_plan_total_bytes":
                totals[s.labels["process"]] = s.value
            elif s.name == "flatserve_process_rss_bytes":
                rss[s.labels["process"]] = s.value
    return parts, totals, rss


def test_the_plan_is_printed_and_exported_beside_the_rss(server):
    log = server.log_path.read_text()
    table = log[log.index("memory plan"):]
    for row in ("api       runtime", "api       media in flight", "engine 0  kv cache",
                "engine 0  pixels in flight", "engine 0  vision workspace", "all       total"):
        assert row in table, table[:3000]
    parts, totals, rss = plan_gauges(server)
    assert set(totals) == {"api", "engine 0"} == set(rss)
    for process, total in totals.items():
        assert total == sum(v for (p, _), v in parts.items() if p == process)
        assert rss[process] < total  # idle, each process is far inside its ceiling
    assert parts["api", "media in flight"] == 2 << 30  # the default --mm-inflight-budget
    assert parts["engine 0", "kv cache"] == 64 << 20  # SMALL_ENGINE_FLAGS
    # the engine's pixels are the API's budget: admission bounds them in both processes
    assert parts["engine 0", "pixels in flight"] == 2 << 30


def serve(*flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "flatserve.cli", "serve", "--port", str(free_port()),
               *SMALL_ENGINE_FLAGS, *flags]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=180)


def test_a_plan_above_the_host_memory_limit_is_refused_in_one_line():
    done = serve("--host-memory-limit", "1G", "--log-level", "warning")
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1, done.stderr[-3000:]
    assert "the memory plan needs" in errors[0]
    assert "--host-memory-limit allows 1,024.0 MiB" in errors[0]
    # the largest parts at the defaults: the image budget counted in each process
    largest = errors[0][errors[0].index("largest parts"):]
    assert "api media in flight 2,048.0 MiB" in largest
    assert "engine 0 pixels in flight 2,048.0 MiB" in largest


def test_a_plan_within_the_limit_serves():
    server = ServerProcess("--host-memory-limit", "64G", "--mm-inflight-budget", str(64 << 20))
    try:
        server.wait_ready()
        parts, totals, _ = plan_gauges(server)
        assert parts["api", "media in flight"] == 64 << 20
        assert sum(totals.values()) <= 64 << 30
    finally:
        server.stop()


def test_a_malformed_limit_fails_before_any_process():
    done = serve("--host-memory-limit", "24X")
    assert done.returncode == 2
    assert "--host-memory-limit" in done.stderr and "'24X' is not a size" in done.stderr


def plan_command(*flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "flatserve.cli", "plan", *SMALL_ENGINE_FLAGS, *flags]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=180)


def table_parts(text: str) -> dict[tuple[str, str], int]:
    parts = {}
    for line in text.splitlines()[2:]:
        cells = [c for c in line.split("  ") if c.strip()]
        parts[cells[0].strip(), cells[1].strip()] = int(cells[2].replace(",", ""))
    return parts


def test_the_dry_run_states_the_served_engine_s_budgets_without_loading_it(server):
    done = plan_command()
    assert done.returncode == 0, done.stderr[-2000:]
    planned = table_parts(done.stdout)
    served, _, _ = plan_gauges(server)
    for part in ("weights", "kv cache", "encoder cache", "step workspace", "vision workspace",
                 "pixels in flight", "admitted requests", "wire buffers", "allocator slack"):
        assert planned["engine 0", part] == served["engine 0", part], part
    for part in ("media in flight", "small bodies", "request state", "media pool"):
        assert planned["api", part] == served["api", part], part
    assert planned["all", "total"] == sum(v for (p, part), v in planned.items()
                                          if part == "total" and p != "all")


def test_the_dry_run_refuses_a_plan_above_the_limit():
    done = plan_command("--host-memory-limit", "1G")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith(
        "flatserve plan: the memory plan needs")
