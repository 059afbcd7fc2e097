"""The bench's server CPU per token (flatserve/bench/server_cpu.py): found from the process on
the server's port, its own time apart from its children's, a child that ended mid-run
counted."""

from __future__ import annotations

import subprocess
import sys

from flatserve.bench.server_cpu import ServerCpu

# listens on a port, then on each "burn" line runs a child that burns ~0.3 s of CPU and ends
# (reaped: what it used shows only in this process's children times), then answers "done"
SERVER = """
import socket, subprocess, sys
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
print(s.getsockname()[1], flush=True)
for line in sys.stdin:
    subprocess.run([sys.executable, "-c",
                    "import time\\nt = time.process_time()\\n"
                    "while time.process_time() - t < 0.3: pass"])
    print("done", flush=True)
"""


def test_a_child_that_ended_during_the_run_counts_under_the_api():
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        with ServerCpu(f"http://127.0.0.1:{port}") as cpu:
            server.stdin.write("burn\n")
            server.stdin.flush()
            assert server.stdout.readline().strip() == "done"
        figures = cpu.per_token_us(1000)  # as if 1,000 tokens came in that time
        assert figures is not None
        assert 250 <= figures["others"] <= 1000  # ~300 us a token: the child's 0.3 s
        assert figures["api"] < figures["others"]
    finally:
        server.kill()
        server.wait()


def test_nothing_is_read_for_a_server_elsewhere():
    with ServerCpu("http://192.0.2.1:8000") as cpu:  # TEST-NET: not this machine
        pass
    assert cpu.per_token_us(100) is None
