"""The bench's server CPU per token (flatserve/bench/server_cpu.py): found from the process on
the server's port, its own time apart from its children's, a child that ended mid-run
counted."""

from __future__ import annotations

import subprocess
import sys

from flatserve.bench.server_cpu import ServerCpu

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
# listens on a port; "burn": runs a child that burns ~0.3 s of CPU and ends (reaped: what it
# used shows only in this process's children times); "start": a child that burns 0.3 s,
# then waits; "finish": that child burns 0.3 s more and ends
SERVER = f"""
import socket, subprocess, sys
BURN = {BURN!r}
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
print(s.getsockname()[1], flush=True)
for line in sys.stdin:
    if line == "burn\\n":
        subprocess.run([sys.executable, "-c", BURN])
    elif line == "start\\n":
        child = subprocess.Popen([sys.executable, "-c", BURN + "print(1, flush=True)\\n"
                                  "input()\\n" + BURN], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        child.stdout.readline()
    else:
        child.stdin.write("go\\n"); child.stdin.flush(); child.wait()
    print("done", flush=True)
"""


class Server:
    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        self.url = f"http://127.0.0.1:{int(self.process.stdout.readline())}"

    def ask(self, command: str) -> None:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        assert self.process.stdout.readline().strip() == "done"

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


def test_a_child_that_ended_during_the_run_counts_under_the_api():
    server = Server()
    try:
        with ServerCpu(server.url) as cpu:
            server.ask("burn")
        figures = cpu.per_token_us(1000)  # as if 1,000 tokens came in that time
        assert figures is not None
        assert 250 <= figures["others"] <= 450  # ~300 us a token: the child's 0.3 s
        assert figures["api"] < figures["others"]
    finally:
        server.close()


def test_only_the_run_s_share_of_a_child_alive_at_its_start_counts():
    server = Server()
    try:
        server.ask("start")  # the child burns 0.3 s before the run
        with ServerCpu(server.url) as cpu:
            server.ask("finish")  # and 0.3 s in it, then ends and is reaped
        figures = cpu.per_token_us(1000)
        assert figures is not None and 250 <= figures["others"] <= 450, figures
    finally:
        server.close()


def test_nothing_is_read_for_a_server_elsewhere():
    with ServerCpu("http://192.0.2.1:8000") as cpu:  # TEST-NET: not this machine
        pass
    assert cpu.per_token_us(100) is None
