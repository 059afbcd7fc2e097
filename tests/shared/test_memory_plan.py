"""The plan type: its table, the refusal line, sizes and the cgroup's memory limit."""

from __future__ import annotations

import argparse

import pytest

from shared.memory_plan import (
    MemoryPart,
    MemoryPlan,
    cgroup_memory_limit,
    format_table,
    over_limit_message,
    parse_size,
)

MiB = 1 << 20
API = MemoryPlan("api", (MemoryPart("runtime", 100 * MiB, "RSS at start"),
                         MemoryPart("media in flight", 64 * MiB, "--mm-inflight-budget")))
ENGINE = MemoryPlan("engine 0", (MemoryPart("runtime", 500 * MiB),
                                 MemoryPart("kv cache", 256 * MiB),
                                 MemoryPart("pixels in flight", 64 * MiB)))


def test_the_table_has_every_part_a_total_per_process_and_one_for_all():
    lines = format_table([API, ENGINE]).splitlines()
    assert lines[0].split()[:5] == ["process", "part", "bytes", "MiB", "from"]
    rows = [line.split("  ") for line in lines[2:]]
    assert len(rows) == 2 + 1 + 3 + 1 + 1
    assert "api       total" in lines[4] and "164.0" in lines[4]
    assert lines[-1].startswith("all") and f"{(164 + 820) * MiB:,}" in lines[-1]
    assert "--mm-inflight-budget" in lines[3]


def test_a_plan_within_the_limit_passes_and_one_above_names_its_largest_parts():
    assert over_limit_message([API, ENGINE], 984 * MiB, "--host-memory-limit") is None
    line = over_limit_message([API, ENGINE], 900 * MiB, "--host-memory-limit")
    assert "\n" not in line
    assert "needs 984.0 MiB and --host-memory-limit allows 900.0 MiB" in line
    assert "engine 0 runtime 500.0 MiB, engine 0 kv cache 256.0 MiB, api runtime 100.0 MiB" \
        in line


@pytest.mark.parametrize("text, nbytes", [("24G", 24 << 30), ("24g", 24 * 10**9),
                                          ("512M", 512 << 20), ("1000", 1000)])
def test_sizes(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["12X", "", "-5", "0", "1.5G", "24GiB"])
def test_bad_sizes_say_what_a_size_is(text):
    with pytest.raises(argparse.ArgumentTypeError, match="size|above zero|whole"):
        parse_size(text)


def _cgroup(tmp_path, proc_line: str, files: dict[str, str]):
    for relative, text in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    proc = tmp_path / "proc_cgroup"
    proc.write_text(proc_line)
    return cgroup_memory_limit(tmp_path, proc)


def test_cgroup_v2_limit_of_the_process_own_group(tmp_path):
    assert _cgroup(tmp_path, "0::/box\n", {"box/memory.max": "1073741824\n"}) == 1 << 30
    assert _cgroup(tmp_path, "0::/box\n", {"box/memory.max": "max\n"}) is None


def test_cgroup_v1_limit_and_its_no_limit_value(tmp_path):
    line = "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n"
    assert _cgroup(tmp_path, line, {"memory/docker/abc/memory.limit_in_bytes": "2147483648"}) \
        == 2 << 30
    assert _cgroup(tmp_path, line, {"memory/docker/abc/memory.limit_in_bytes":
                                    "9223372036854771712"}) is None


def test_no_cgroup_files_mean_no_limit(tmp_path):
    assert _cgroup(tmp_path, "0::/\n", {}) is None
