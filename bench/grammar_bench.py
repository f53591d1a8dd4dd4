"""Structured output, per-token cost: llama.cpp's GBNF sampler (the old path) against llguidance (service/grammar/schema.py).

On the embedded gemma-3-270m (262,144-token vocabulary), for a JSON schema:

1. the sampler alone: the time one grammar step takes over the whole vocabulary (``llama_sampler_apply`` on a
   full candidate array, then ``accept`` of the next token of a valid answer), GBNF vs llguidance;
2. end to end: greedy generation through ``llama_cpp.Llama.generate`` without a grammar, with the GBNF
   grammar (``LlamaGrammar``, what the service used before) and with llguidance (``grammar_logits_processor``,
   what ``LlamaEngine`` uses now): milliseconds per generated token.

Run it alone on an idle machine (figures from a loaded one measure the neighbours):

    .venv/bin/python bench/grammar_bench.py            # about a minute
    .venv/bin/python bench/grammar_bench.py --steps 20 --tokens 24 --runs 1   # a quick look
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
ANSWER = '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines"], "ok": true}'


def _ms(xs: list[float]) -> str:
    return f"median {statistics.median(xs) * 1e3:.3f} ms, min {min(xs) * 1e3:.3f} ms"


def sampler_steps(model_path: str, steps: int) -> None:
    import llama_cpp
    from llama_cpp import llama_grammar

    from service.engine.base import GenerationParams
    from service.engine.grammar_sampler import grammar_sampler
    from service.grammar.schema import compile_grammar

    mp = llama_cpp.llama_model_default_params()
    mp.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(model_path.encode(), mp)
    vocab = llama_cpp.llama_model_get_vocab(model)
    n = int(llama_cpp.llama_vocab_n_tokens(vocab))
    buf = (ctypes.c_int32 * 256)()
    k = llama_cpp.llama_tokenize(vocab, ANSWER.encode(), len(ANSWER.encode()), buf, 256, False, False)
    answer = list(buf[:k])
    arr = (llama_cpp.llama_token_data * n)()

    def fill() -> llama_cpp.llama_token_data_array:
        for i in range(n):
            arr[i].id, arr[i].logit, arr[i].p = i, 0.0, 0.0
        return llama_cpp.llama_token_data_array(data=arr, size=n, selected=-1, sorted=False)

    gbnf = llama_grammar.json_schema_to_gbnf(json.dumps(SCHEMA))
    t0 = time.perf_counter()
    g = compile_grammar(GenerationParams(json_schema=json.dumps(SCHEMA)))
    t_compile = time.perf_counter() - t0
    assert g is not None
    t0 = time.perf_counter()
    grammar_sampler(vocab, g)  # builds llguidance's tokenizer for this vocabulary (once per model)
    t_tok = time.perf_counter() - t0
    print(f"FIGURE llguidance: schema compiled and validated in {t_compile * 1e3:.2f} ms; "
          f"tokenizer for {n} tokens built in {t_tok:.2f} s (once per loaded model)")
    results = {}
    for label, make in (
        ("gbnf", lambda: llama_cpp.llama_sampler_init_grammar(vocab, gbnf.encode(), b"root")),
        ("llguidance", lambda: grammar_sampler(vocab, g)),
    ):
        times: list[float] = []
        done = 0
        while done < steps:
            s = make()
            assert s, f"{label}: no sampler"
            for tok in answer:
                if done >= steps:
                    break
                cur = fill()
                t0 = time.perf_counter()
                llama_cpp.llama_sampler_apply(s, ctypes.byref(cur))
                llama_cpp.llama_sampler_accept(s, tok)
                times.append(time.perf_counter() - t0)
                done += 1
            llama_cpp.llama_sampler_free(s)
        results[label] = times
        print(f"FIGURE sampler step over {n} tokens, {label}: {_ms(times)} ({len(times)} steps)")
    ratio = statistics.median(results["gbnf"]) / statistics.median(results["llguidance"])
    print(f"FIGURE sampler step: llguidance is {ratio:.0f}x faster than llama.cpp's GBNF sampler")
    llama_cpp.llama_model_free(model)


def end_to_end(model_path: str, tokens: int, runs: int) -> None:
    from llama_cpp import Llama, llama_grammar

    from service.engine.base import GenerationParams
    from service.engine.grammar_sampler import grammar_logits_processor
    from service.grammar.schema import compile_grammar

    llm = Llama(model_path=model_path, n_ctx=1024, verbose=False)
    prompt = llm.tokenize(b"A person as JSON:", add_bos=True)
    g = compile_grammar(GenerationParams(json_schema=json.dumps(SCHEMA)))
    assert g is not None
    gbnf = llama_grammar.LlamaGrammar.from_string(llama_grammar.json_schema_to_gbnf(json.dumps(SCHEMA)), verbose=False)

    def one(kind: str) -> tuple[float, int, str]:
        kwargs: dict[str, object] = {}
        if kind == "gbnf":
            kwargs["grammar"] = gbnf
        elif kind == "llguidance":
            kwargs["logits_processor"] = [grammar_logits_processor(llm._model.vocab, g)]
        llm.reset()
        out: list[int] = []
        t_first = 0.0
        for tok in llm.generate(prompt, top_k=0, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True,
                                **kwargs):  # type: ignore[arg-type]
            if not out:
                t_first = time.perf_counter()
            if llm._model.token_is_eog(tok) if hasattr(llm._model, "token_is_eog") else tok == llm.token_eos():
                break
            out.append(tok)
            if len(out) >= tokens:
                break
        t_end = time.perf_counter()
        per_token = (t_end - t_first) / max(len(out) - 1, 1)
        return per_token, len(out), llm.detokenize(out).decode("utf-8", "replace")

    one("none")  # warm-up
    for kind in ("none", "gbnf", "llguidance"):
        figures = [one(kind) for _ in range(runs)]
        per = [f[0] for f in figures]
        print(f"FIGURE generate, {kind}: {statistics.median(per) * 1e3:.2f} ms per token after the first "
              f"({figures[-1][1]} tokens); output {figures[-1][2][:70]!r}")
    llm.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="sampler steps per grammar engine")
    ap.add_argument("--tokens", type=int, default=48, help="tokens per end-to-end generation")
    ap.add_argument("--runs", type=int, default=3, help="end-to-end generations per configuration")
    args = ap.parse_args(argv)
    from service.catalog.embedded import embedded_model_path

    path = embedded_model_path()
    sampler_steps(path, args.steps)
    end_to_end(path, args.tokens, args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
