"""A tensor-parallel worker rank: `python -m engine_proc.tp_worker --rank R --spec-json ...`,
started by rank 0 (engine_proc/tensor_parallel.py), never by hand.

It joins the engine's group, builds its ModelRunner (its shard of the decoder and of the KV
cache, no vision tower), then loops: read a step's inputs from stdin, receive the step's
image rows if it has any, run the forward. It holds nothing between steps but the weights
and its KV cache (R3: a step's image rows are locals of `run_step`). End of file on stdin
means rank 0 is gone; any error ends the process, which rank 0 sees at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

import numpy as np

from shared.memory import ENGINE_MALLOC_ENV, apply_malloc_settings, bound_kernel_caches
from shared.process import die_with_parent, set_process_title

logger = logging.getLogger("engine_proc.tp_worker")


def read_exact(fd: int, num_bytes: int) -> bytearray | None:
    """Exactly `num_bytes` from `fd`, or None at end of file."""
    buffer = bytearray(num_bytes)
    view = memoryview(buffer)
    while view:
        n = os.readv(fd, [view])
        if n == 0:
            return None
        view = view[n:]
    return buffer


def receive_step(fd: int):
    """The next step's StepInputs from rank 0's pipe; None when told to exit or at end of
    file."""
    from engine_proc.step_inputs import HEADER_BYTES, OP_STEP, StepInputs

    raw = read_exact(fd, HEADER_BYTES)
    if raw is None:
        return None
    header = np.frombuffer(raw, dtype=np.int64)
    if header[0] != OP_STEP:
        return None
    payload = read_exact(fd, StepInputs.payload_bytes(header))
    if payload is None:
        return None
    return StepInputs.decode(header, payload)


def receive_image_rows(runner, inputs):
    """The step's image rows, broadcast by rank 0 (None for a text-only step)."""
    import torch

    from engine_proc.distributed import broadcast_from_first, tp_shard

    if not len(inputs.image_rows):
        return None
    num_rows = int(inputs.image_rows[:, 1].sum())
    values = torch.empty((num_rows, inputs.image_width), dtype=runner.dtype, device=runner.device)
    return broadcast_from_first(values, tp_shard())


def run_step(runner, inputs, values) -> None:
    """One step's forward on this rank; `values`: the step's image rows or None."""
    from engine_proc.step_inputs import forward_step, split_image_rows

    pieces = [] if values is None else split_image_rows(inputs, values)
    del values
    if runner.staging is not None:
        runner.staging.reset()
    forward_step(runner.model, inputs, pieces, runner._to_device, runner.state_cache)


def serve(runner, fd: int) -> None:
    while (inputs := receive_step(fd)) is not None:
        run_step(runner, inputs, receive_image_rows(runner, inputs))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="flatserve tensor-parallel worker rank")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--spec-json", required=True)
    args = parser.parse_args(argv)
    spec = json.loads(args.spec_json)
    label = spec["label"]  # "engine N" in a server
    name = f"{label.replace(' ', '')} tp{args.rank}".strip()
    logging.basicConfig(level=spec["log_level"],
                        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")
    set_process_title(f"flatserve: {label} tp rank {args.rank}".replace("  ", " "))
    die_with_parent()  # also stops a worker stuck in a collective when rank 0 dies
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops us
    apply_malloc_settings(ENGINE_MALLOC_ENV)
    bound_kernel_caches()

    import torch
    import torch.distributed as dist

    from engine_proc.distributed import init_group
    from engine_proc.model_runner import ModelRunner
    from engine_proc.tensor_parallel import STORE_HOST, rank_device
    from shared.model_config import load_model_config

    if spec["torch_threads"]:
        torch.set_num_threads(spec["torch_threads"])
    kwargs = dict(spec["runner"])
    device = rank_device(torch.device(kwargs.pop("device")), args.rank)
    store = dist.TCPStore(STORE_HOST, spec["store_port"], spec["size"], is_master=False)
    store.set(f"joined/{args.rank}", "1")
    init_group(args.rank, spec["size"], store, device)
    config = load_model_config(kwargs.pop("model"))
    runner = ModelRunner(config, device=device, vision=False, **kwargs)
    logger.info("rank %d of %d ready on %s (%d KV blocks)", args.rank, spec["size"], device,
                runner.num_kv_blocks)
    serve(runner, sys.stdin.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
