"""`vllm serve` flags that flatserve has no setting for. Each is either accepted at the values
that change nothing here (the flag describes what flatserve always does) or refused by name,
at parse time, with the reason it cannot apply: never argparse's bare "unrecognized
arguments", never silently ignored. The flags flatserve implements are its own settings
(api_proc/config.py, shared/engine_config.py, flatserve/cli.py), under vLLM's names."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

ANY = "*"  # every value changes nothing


@dataclass(frozen=True)
class VllmFlag:
    names: tuple[str, ...]
    why: str  # what flatserve does instead: the whole reason
    takes_value: bool = True  # False: a switch
    no_op: tuple[str, ...] = ()  # values accepted as changing nothing (a switch: its spellings)

    def accepts(self, option: str, value: str | None) -> bool:
        if not self.takes_value:
            return option in self.no_op
        return value is not None and (ANY in self.no_op or value in self.no_op)


NO_HUB = "flatserve serves local checkpoint folders only: no hub downloads"
NO_LORA = "no LoRA adapters"
EAGER = ("no torch.compile: CUDA graphs are flatserve's own (--no-enforce-eager, "
         "--cudagraph-mode, --cudagraph-capture-sizes, --max-cudagraph-capture-size)")
SYNC_STEPS = ("an engine schedules each step once the step before it has sampled its tokens "
              "(no asynchronous scheduling)")

FLAGS = (
    # accepted where they describe what flatserve always does
    VllmFlag(("--trust-remote-code", "--no-trust-remote-code"),
             "flatserve runs no code from model folders (its own model code, tokenizer.json "
             "read directly)", False, ("--trust-remote-code", "--no-trust-remote-code")),
    VllmFlag(("--enable-chunked-prefill",),
             "chunked prefill is always on (--max-num-batched-tokens per step)", False,
             ("--enable-chunked-prefill",)),
    VllmFlag(("--no-enable-chunked-prefill",),
             "chunked prefill is always on (--max-num-batched-tokens per step)", False),
    VllmFlag(("--disable-fastapi-docs",), "flatserve serves no docs pages", False,
             ("--disable-fastapi-docs",)),
    VllmFlag(("--disable-log-stats",),
             "flatserve logs no periodic stats (GET /metrics is not affected)", False,
             ("--disable-log-stats",)),
    VllmFlag(("--max-log-len",), "flatserve never logs prompt text or token ids",
             no_op=(ANY,)),
    VllmFlag(("--disable-sliding-window",), "flatserve's decoders use no sliding window",
             False, ("--disable-sliding-window",)),
    VllmFlag(("--load-format",), "weights load from the folder's safetensors",
             no_op=("auto", "safetensors")),
    VllmFlag(("--kv-cache-dtype",), "the KV cache has the model's dtype (--dtype)",
             no_op=("auto",)),
    VllmFlag(("--tokenizer-mode",), "the fast tokenizer (tokenizer.json) is always used",
             no_op=("auto",)),
    VllmFlag(("--swap-space",), "preemption recomputes: there is no CPU swap space",
             no_op=("0",)),
    VllmFlag(("--cpu-offload-gb",), "weights stay on the engine's device", no_op=("0",)),
    VllmFlag(("--pipeline-parallel-size", "-pp"), "no pipeline parallelism", no_op=("1",)),
    VllmFlag(("--scheduling-policy",), "requests are scheduled first come, first served",
             no_op=("fcfs",)),
    VllmFlag(("--response-role",), "responses carry the role assistant",
             no_op=("assistant",)),
    VllmFlag(("--task", "--runner"), "flatserve generates text (no pooling or embeddings)",
             no_op=("auto", "generate")),
    VllmFlag(("--guided-decoding-backend",), "structured outputs use xgrammar",
             no_op=("auto", "xgrammar")),
    VllmFlag(("--no-async-scheduling",), SYNC_STEPS, False, ("--no-async-scheduling",)),
    VllmFlag(("--attention-backend",),
             "attention runs flatserve's own kernels for the device (FlashAttention's varlen "
             "and a Triton paged decode kernel on CUDA, C kernels on a CPU)", no_op=("auto",)),
    VllmFlag(("--mm-processor-cache-gb",),
             "no processor cache: the encoder cache keeps vision embeddings "
             "(--encoder-cache-bytes)", no_op=("0",)),
    # refused
    VllmFlag(("--tokenizer",), "the tokenizer is the model folder's own"),
    VllmFlag(("--revision", "--code-revision", "--tokenizer-revision", "--download-dir",
              "--hf-token"), NO_HUB),
    VllmFlag(("--quantization", "-q"), "weights run unquantized, in --dtype"),
    VllmFlag(("--max-num-partial-prefills", "--max-long-partial-prefills"),
             "prefills are bounded by the step's token budget (--max-num-batched-tokens) alone",
             no_op=("1",)),
    VllmFlag(("--long-prefill-token-threshold",),
             "prefills are bounded by the step's token budget (--max-num-batched-tokens) alone",
             no_op=("0",)),
    VllmFlag(("--enable-lora",), NO_LORA, False),
    VllmFlag(("--lora-modules", "--max-loras", "--max-lora-rank"), NO_LORA),
    VllmFlag(("--speculative-config",), "no speculative decoding"),
    VllmFlag(("--compilation-config", "-O", "--optimization-level"), EAGER),
    VllmFlag(("--async-scheduling",), SYNC_STEPS, False),
    VllmFlag(("--performance-mode",),
             "no performance modes: the batch is --max-num-seqs and --max-num-batched-tokens, "
             "the CUDA graphs' sizes --cudagraph-capture-sizes and --max-cudagraph-capture-size"),
    VllmFlag(("--enable-expert-parallel", "-ep"), "no expert parallelism", False),
    VllmFlag(("--distributed-executor-backend",),
             "engines and their ranks are flatserve's own processes (vLLM's mp)",
             no_op=("mp",)),
    VllmFlag(("--kv-transfer-config",), "no KV transfer between engines"),
    VllmFlag(("--enable-sleep-mode",), "no sleep mode", False),
    VllmFlag(("--middleware",), "no ASGI middleware is loaded by import path"),
    VllmFlag(("--config",), "no YAML config file: pass the flags"),
    VllmFlag(("--headless",), "the API process always runs with its engines", False),
    VllmFlag(("--api-server-count", "-asc"), "one API process", no_op=("1",)),
    VllmFlag(("--chat-template-content-format",),
             "message content reaches the chat template as sent: a string, or a list of parts",
             no_op=("auto",)),
    VllmFlag(("--override-generation-config", "--hf-overrides"),
             "settings come from the model folder; --generation-config names another folder"),
    VllmFlag(("--enable-prompt-tokens-details",
              "--enable-request-id-headers",
              "--enable-tokenizer-info-endpoint", "--enable-log-outputs"),
             "not implemented", False),
)


class _VllmFlagAction(argparse.Action):
    def __init__(self, option_strings, dest, flag: VllmFlag, **kwargs) -> None:
        self.flag = flag
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        value = values[0] if isinstance(values, list) and values else values
        if self.flag.accepts(option_string, value):
            return  # changes nothing here
        shown = option_string if value in (None, []) else f"{option_string} {value}"
        if self.flag.no_op and self.flag.takes_value:
            accepted = ", ".join(self.flag.no_op)
            parser.error(f"{shown} cannot apply here: {self.flag.why} (accepted: {accepted})")
        parser.error(f"{shown} cannot apply here: {self.flag.why}")


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Add every flag of FLAGS, with its reason as its help."""
    group = parser.add_argument_group(
        "vLLM flags without a flatserve setting",
        "accepted where they change nothing here (the values named), refused otherwise")
    for flag in FLAGS:
        if flag.takes_value:
            nargs = None if flag.no_op else "?"
            accepted = f" (accepted: {', '.join(flag.no_op)})" if flag.no_op else " (refused)"
        else:
            nargs = 0
            accepted = " (accepted)" if flag.no_op else " (refused)"
        group.add_argument(*flag.names, action=_VllmFlagAction, flag=flag, nargs=nargs,
                           dest="vllm_" + flag.names[0].lstrip("-").replace("-", "_"),
                           default=argparse.SUPPRESS, metavar="VALUE",
                           help=flag.why.replace("%", "%%") + accepted)
