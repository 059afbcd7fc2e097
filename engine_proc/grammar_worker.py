"""The grammar compiler process (`python -m engine_proc.grammar_worker`), started by
structured_output.py: a compile that runs past its time budget, or whose request is
aborted, is stopped by ending this process, which a thread in the engine cannot do.

Protocol, over stdin and stdout: the engine writes one JSON line {"kind", "spec"} per
grammar; this process answers with one JSON line, {"error": text} or {"size": n}, the
latter followed by n bytes: the compiled grammar's serialize_json() text.
"""

from __future__ import annotations

import json
import sys

from shared.process import die_with_parent
from shared.sampling_params import MAX_JSON_WHITESPACE

# xgrammar 0.2.8 writes a string with minLength/maxLength as a run of _LOOSE_CHARACTER, which
# lets a raw control character through: invalid JSON (json.loads refuses it). Its other
# string rules use _JSON_CHARACTER, which also leaves out \0-\x1f (\r and \n among them).
_LOOSE_CHARACTER = r'[^\"\\\r\n]'
_JSON_CHARACTER = r'[^\0-\x1f\"\\]'


def _json_strings_without_controls(ebnf: str) -> str:
    return ebnf.replace(_LOOSE_CHARACTER, _JSON_CHARACTER)


def load_xgrammar(tokenizer_dir: str, vocab_size: int, eos_token_ids: list[int]):
    """xgrammar and its tokenizer info for the model."""
    # xgrammar imports triton when it is installed; the bitmask is applied by its CPU
    # kernel or torch, so a CPU-only setup without triton works the same
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=f"{tokenizer_dir}/tokenizer.json")
    return xgr, xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                   stop_token_ids=eos_token_ids)


def compile_grammar(xgr, compiler, kind: str, spec: str):
    """The compiled grammar; ValueError with the reason when the spec cannot compile."""
    try:
        if kind in ("json", "json_object"):
            schema = spec if kind == "json" else '{"type": "object"}'
            grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=True,
                                                   max_whitespace_cnt=MAX_JSON_WHITESPACE)
            return compiler.compile_grammar(_json_strings_without_controls(str(grammar)))
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "structural_tag":  # through EBNF text, for the same string fix
            grammar = xgr.Grammar.from_structural_tag(spec)
            return compiler.compile_grammar(_json_strings_without_controls(str(grammar)))
        if kind == "choice":
            choices = json.loads(spec)
            ebnf = "root ::= " + " | ".join(json.dumps(c) for c in choices)
            return compiler.compile_grammar(ebnf)
        return compiler.compile_grammar(spec)
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError with the reason
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        what = "tools' parameters" if kind == "structural_tag" else f"{kind} constraint"
        raise ValueError(f"cannot compile the {what}: {message}") from None


def main() -> None:
    die_with_parent()
    tokenizer_dir, vocab_size, eos, cache_bytes, max_bytes = sys.argv[1:6]
    xgr, info = load_xgrammar(tokenizer_dir, int(vocab_size), json.loads(eos))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=int(cache_bytes))
    out = sys.stdout.buffer
    out.write(b'{"ready": true}\n')
    out.flush()
    for line in sys.stdin.buffer:
        job = json.loads(line)
        try:
            compiled = compile_grammar(xgr, compiler, job["kind"], job["spec"])
            if compiled.memory_size_bytes > int(max_bytes):
                raise ValueError(f"the compiled {job['kind']} constraint takes "
                                 f"{compiled.memory_size_bytes} bytes, more than the "
                                 f"{max_bytes} a request may use")
        except ValueError as e:
            out.write(json.dumps({"error": str(e)}).encode() + b"\n")
            out.flush()
            continue
        data = compiled.serialize_json().encode()
        compiled = None
        out.write(json.dumps({"size": len(data)}).encode() + b"\n")
        out.write(data)
        out.flush()


if __name__ == "__main__":
    main()
