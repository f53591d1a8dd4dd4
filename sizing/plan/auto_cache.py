"""``cache_type = "auto"``: the most precise KV cache type that reaches the context ceiling.

A quantized cache buys context (in the same KV memory q8_0 holds 1.9 times the tokens of f16, q4_0 3.6
times: 34 and 18 bytes a block of 32 elements against 64) and costs speed where llama.cpp runs attention on
the CPU: with flash attention a 1,793-token prompt of the embedded gemma-3-270m was evaluated at 321 tokens/s
with a q8_0 cache against 572 with f16, and the service's cold 1,761-token prompt took 1.25x llama-server's
time with q8_0, 1.06x with f16 (docs/batching.md, ``bench/serving_bench.py``). On that host f16 already
reaches the model's whole n_ctx_train, so q8_0 bought nothing. ``auto`` quantizes only where that buys
context:

1. f16 when its planned context reaches the ceiling (``ctx_cap``: n_ctx_train, ``context_length``, a
   requested n_ctx);
2. else q8_0 when it reaches it;
3. else whichever type gives the largest context, the more precise one on a tie (q8_0 before q4_0).

A type that is refused (a quantized cache with flash attention off or unsupported, a head size its block
does not divide) is never chosen. One rule comes first: where some type keeps the model whole on the cards
(``held_whole_verdict``) the types that would need layers in host memory are not considered, since a partial
offload reads those layers at host bandwidth on every token, which costs far more than a quantized cache's
attention (``sizing.plan.offload``'s speed model); on a machine without cards every fitting type is whole.

Pure: the rows ``make_plan`` already sized go in, one of them and the sentence that says why come out.
"""

from __future__ import annotations

from typing import Sequence

from .sizer import CacheTypeOption, held_whole_verdict


def _fits(o: CacheTypeOption) -> bool:
    return o.verdict != "refused" and o.n_ctx > 0


def _short(o: CacheTypeOption, cap: int, partial: bool) -> str:
    """Why a type was passed over, in a few words; ``partial``: it fits only partly offloaded, where another
    type keeps the model whole."""
    if o.refusal == "INVALID_CONFIG":
        return f"{o.cache_type} refused"
    if not _fits(o):
        return f"{o.cache_type} does not fit"
    if partial:
        return f"{o.cache_type} only with layers in host memory"
    return f"{o.cache_type} reaches only {o.n_ctx} of {cap}"


def choose_cache_type(options: Sequence[CacheTypeOption], cap: int, has_gpus: bool) -> tuple[CacheTypeOption, str]:
    """The row ``auto`` loads with, among ``options`` (the candidates, most precise first), and why.

    ``cap``: the context ceiling. ``has_gpus``: whether the machine has cards (a CPU-only plan is then not whole).
    When no type fits, the refusal shown is the least demanding valid type's (its figures say even that does
    not fit), or the first row's when every one is an invalid configuration (its error names the setting).
    """
    if not options:
        raise ValueError("auto needs at least one cache type to choose from")
    fitting = [o for o in options if _fits(o)]
    if not fitting:
        valid = [o for o in options if o.refusal != "INVALID_CONFIG"]
        tried = ", ".join(o.cache_type for o in options)
        if not valid:
            return options[0], f"cache type auto: every type refused ({tried}); {options[0].cache_type}'s error shown"
        shown = valid[-1]
        return shown, f"cache type auto: no type fits ({tried} tried); the figures shown are {shown.cache_type}'s"
    whole = {id(o) for o in fitting if held_whole_verdict(o.verdict, has_gpus)}
    pool = [o for o in fitting if id(o) in whole] or fitting
    reaching = [o for o in pool if o.n_ctx >= cap]
    if reaching:
        chosen = reaching[0]
        head = f"cache type auto: {chosen.cache_type} reaches the ceiling {cap}"
        passed = list(options[: next(i for i, o in enumerate(options) if o is chosen)])
    else:
        chosen = max(pool, key=lambda o: o.n_ctx)  # max keeps the first of equals: the more precise type
        head = f"cache type auto: {chosen.cache_type} gives the largest context, {chosen.n_ctx} of {cap}"
        passed = [o for o in options if o is not chosen]
    why = [_short(o, cap, bool(whole) and id(o) not in whole and _fits(o)) for o in passed]
    return chosen, head + (f" ({', '.join(why)})" if why else "")


__all__ = ["choose_cache_type"]
