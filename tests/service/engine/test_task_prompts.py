"""llama-server's FIM layout and truncation (``infill_layout``), pure: exact token orders and cuts."""

from __future__ import annotations

from service.text.tasks import FimTokens, infill_layout

FIM = FimTokens(pre=900, suf=901, mid=902, pad=903, rep=904, sep=905)


def _layout(**kw: object) -> list[int]:
    args: dict[str, object] = {"extra": [], "prefix": [], "suffix": [], "prompt": [], "bos": None, "n_batch": 512,
                               "n_ctx": 4096, "n_predict": 0}
    args.update(kw)
    return infill_layout(FIM, **args)  # type: ignore[arg-type]


def test_order_is_extra_bos_pre_prefix_prompt_suf_suffix_mid() -> None:
    got = _layout(extra=[1, 2], prefix=[10, 11], suffix=[20], prompt=[30], bos=7)
    assert got == [1, 2, 7, 900, 10, 11, 30, 901, 20, 902]


def test_the_prefix_keeps_its_end_and_the_suffix_its_start() -> None:
    prefix, suffix = list(range(10_000, 11_000)), list(range(20_000, 21_000))
    got = _layout(prefix=prefix, suffix=suffix, prompt=[5, 6, 7], n_batch=512)
    i_pre, i_suf = got.index(900), got.index(901)
    assert got[i_pre + 1:i_suf] == prefix[-384:] + [5, 6, 7], "3 * (512 / 4) tokens of the prefix, then the prompt"
    assert got[i_suf + 1:-1] == suffix[:128 - 2 - 3], "512 / 4 less 2 and the prompt's tokens"


def test_a_long_prompt_leaves_no_suffix_and_is_kept_whole() -> None:
    got = _layout(suffix=[1, 2, 3], prompt=list(range(200)), n_batch=512)
    assert got[-2:] == [901, 902] and got.count(901) == 1
    assert len(got) == 1 + 200 + 2


def test_extra_keeps_its_end_within_the_context_left_for_the_answer() -> None:
    extra = list(range(5000))
    got = _layout(extra=extra, n_ctx=2048, n_batch=512, n_predict=100)
    assert got[:-3] == extra[-(2048 - 512 - 200):]
    assert _layout(extra=extra, n_ctx=600, n_batch=512, n_predict=100) == [900, 901, 902], "no room: no extra"


def test_missing_names_the_required_tokens_by_their_gguf_keys() -> None:
    assert FIM.missing() == []
    assert FimTokens(pre=1, mid=3).missing() == ["tokenizer.ggml.fim_suf_token_id"]
    assert FimTokens().missing() == [f"tokenizer.ggml.fim_{n}_token_id" for n in ("pre", "suf", "mid")]
