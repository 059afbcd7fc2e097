"""A small CPU LLMEngine on the tiny checkpoint, shared by the engine tests."""

from __future__ import annotations

from engine_proc.llm_engine import LLMEngine


def make_engine(path, **kw) -> LLMEngine:
    args = dict(
        max_num_seqs=8,
        max_num_batched_tokens=512,
        max_model_len=1024,
        num_kv_blocks=256,
        device="cpu",
        # the decode share picks decode-only steps by the clock: tests that check what each
        # step does need the schedule without it (test_engine.py runs it on)
        decode_share=0.0,
    )
    args.update(kw)
    return LLMEngine(str(path), **args)
