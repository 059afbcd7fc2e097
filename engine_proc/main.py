"""Entry point of one engine process: `python -m engine_proc.main --config-json '{...}'`."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import NoReturn

import zmq

from shared.engine_config import EngineConfig
from shared.memory import ENGINE_MALLOC_ENV, apply_malloc_settings, bound_kernel_caches
from shared.process import die_with_parent, exit_without_teardown, set_process_title

ZMQ_TERM_S = 2.0  # the socket lingers 0.2 s; past this the exit goes on without zmq


def main(argv: list[str] | None = None) -> NoReturn:
    parser = argparse.ArgumentParser(description="flatserve engine worker process")
    parser.add_argument("--config-json", required=True, help="EngineConfig as JSON")
    parser.add_argument("--die-with-parent", action="store_true",
                        help="exit when the launching process exits (set by flatserve serve)")
    args = parser.parse_args(argv)
    config = EngineConfig.from_json(args.config_json)
    logging.basicConfig(
        level=config.log_level.upper(),
        format=f"%(asctime)s engine{config.rank} %(levelname)s %(name)s: %(message)s",
    )
    set_process_title(f"flatserve: engine {config.rank}")
    apply_malloc_settings(ENGINE_MALLOC_ENV)
    bound_kernel_caches()
    if args.die_with_parent:
        die_with_parent()

    import torch

    from engine_proc import tensor_parallel
    from engine_proc.engine_process import EngineProcess
    from engine_proc.model_runner import resolve_device

    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    elif (config.tensor_parallel_size > 1 and resolve_device(config.device).type == "cpu"
          and "OMP_NUM_THREADS" not in os.environ):
        # the ranks share the cores (each worker takes as many threads as this rank)
        torch.set_num_threads(max(1, torch.get_num_threads() // config.tensor_parallel_size))
    torch.manual_seed(config.seed)  # unseeded sampling draws from torch's global generators
    # Not niced by default: on a CPU a lower-priority engine's OpenMP threads are preempted
    # by every wake-up of the API and the clients, and its other threads wait at the next
    # barrier (text c=32 on 2 cores: 33.0 and 31.6 req/s at 0 against 27.6 and 4.6 at +10).
    nice = config.engine_nice
    if nice:
        os.nice(nice)
    logging.getLogger(__name__).info(
        "torch intra-op threads: %d, niceness +%d", torch.get_num_threads(), nice
    )
    tensor_parallel.exit_on_early_failure = True  # a worker lost while loading: exit now
    process = EngineProcess(config)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: process.stop())
    code = process.run()
    # Done: the last step is handed to zmq, whose term() waits it out (the socket's linger).
    # Then exit without the interpreter's teardown: freeing torch's state took 0.5 s more
    # (measured, on every stop of `flatserve serve`, and after a broken tensor-parallel
    # group); children (compiler, ranks) are stopped or die with this process.
    terminating = threading.Thread(target=zmq.Context.instance().term, daemon=True)
    terminating.start()
    terminating.join(ZMQ_TERM_S)  # bounded: a socket left open would hold term() forever
    exit_without_teardown(code)


if __name__ == "__main__":
    sys.exit(main())
