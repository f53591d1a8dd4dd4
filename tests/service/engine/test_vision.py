"""Images into the engine (issue 27): the embedded model with a small projector of its width (random weights: the
answers mean nothing, the plumbing and the memory are real), loaded by llama.cpp's mtmd.

What can break: the projector's buffers beside the plan, an image's tokens in the prompt and its count, the image
evaluated into the sequence (a different image, a different answer), prefix reuse across turns that carry the
same image and never across a different one (the answer after reuse is the answer evaluated cold), drafts that
stop before an image's ids, and the refusals."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import pytest

from service.engine.base import Cancel, Chunk, GenerationParams, ImageInput
from service.engine.llama import LlamaEngine
from service.text.served import ServedModel
from service.engine.speculation import NgramDrafter
from service.engine.vision import image_run
from service.errors import BadRequest
from sizing.memory import Projector
from sizing.plan.make import Plan, PlanRequest, make_plan
from sizing.probe import probe_path
from sizing.probe.devices import host_memory
from sizing.probe.mtmd import measure_projector
from sizing.probe.projector import probe_projector
from sizing.memory import mib_to_bytes
from sizing.testing.projector_fixtures import TINY, write_projector

pytestmark = pytest.mark.slow

MIB = 1 << 20
GREEDY = GenerationParams(max_tokens=12, temperature=0.0)


def _image(seed: int, w: int = 40, h: int = 24) -> ImageInput:
    return ImageInput.of(w, h, bytes((seed * 37 + i * 11) % 256 for i in range(w * h * 3)))


def _chat(image: ImageInput | None, text: str = "What is in the picture?") -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    if image is not None:
        parts.append({"type": "image", "image": image})
        parts.append({"type": "text", "text": "Answer briefly."})
    return [{"role": "user", "content": parts}]


def _run(eng: LlamaEngine, tokens: list[int], params: GenerationParams = GREEDY) -> tuple[str, Chunk]:
    chunks = list(eng.generate(tokens, params, Cancel()))
    return "".join(c.text for c in chunks), chunks[-1]


@pytest.fixture(scope="module")
def projector_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("vision") / "tiny-mmproj-f32.gguf"
    write_projector(path, TINY, values="random")
    return str(path)


def _plan(model: str, projector: Projector | None, slots: int = 2) -> Plan:
    return make_plan(probe_path(model), [], host_memory(),
                     PlanRequest(n_ctx=2048, n_seq_max=slots, kv_unified=True, min_ctx=256, cpu_repack=False,
                                 projector=projector))


@pytest.fixture(scope="module")
def loaded(embedded_model: str, projector_path: str) -> Iterator[tuple[LlamaEngine, Plan, Any]]:
    figures = {("CPU", fa): mib_to_bytes(measure_projector(projector_path, fa).compute_mib["CPU"]) for fa in (True, False)}
    plan = _plan(embedded_model, Projector(probe_projector(projector_path), figures=figures))
    eng = ServedModel.of(LlamaEngine())
    report = eng.load(embedded_model, plan)
    yield eng, plan, report
    eng.unload()


def test_the_projector_allocates_what_the_plan_predicted(loaded: tuple[LlamaEngine, Plan, Any]) -> None:
    _, plan, report = loaded
    pm = plan.estimate.projector
    assert pm is not None and pm.compute_source == "measured" and pm.device == "CPU"
    (alloc,) = report.projector_allocations
    assert alloc.device == "CPU"
    # mtmd logs 0.01 MiB figures; the plan's weights are every tensor's bytes, its compute buffer mtmd's measured.
    assert abs(alloc.weights_bytes - pm.weights_bytes) <= 0.01 * MIB
    assert abs(alloc.compute_bytes - pm.compute_bytes) <= 0.01 * MIB
    # The model's own buffers are the plan's without the projector's: nothing of it in the main context's rows.
    assert all(a.device != "CPU" or a.weights_bytes < plan.estimate.host.weights_bytes + MIB for a in report.allocations)


def test_an_image_takes_its_tokens_in_the_prompt_and_changes_the_answer(loaded: tuple[LlamaEngine, Plan, Any]) -> None:
    eng, plan, _ = loaded
    tokens = eng.chat_prompt_tokens(_chat(_image(1)))
    n_image = plan.estimate.projector.tokens_per_image
    assert n_image and sum(1 for t in tokens if t < 0) == n_image
    assert eng.count_chat_tokens(_chat(_image(1))) == len(tokens)
    text = eng.render_chat(_chat(_image(1)))
    assert "<__media__>" in text and "Answer briefly." in text
    # The same image, the same ids; another image, others; the text around them the model's own.
    assert eng.chat_prompt_tokens(_chat(_image(1))) == tokens
    other = eng.chat_prompt_tokens(_chat(_image(2)))
    assert len(other) == len(tokens) and other != tokens
    assert [t for t in other if t >= 0] == [t for t in tokens if t >= 0]
    _, last = _run(eng, tokens, replace(GREEDY, cache_prompt=False))
    assert last.prompt_tokens == len(tokens) and last.completion_tokens > 0
    # The image reaches the model: the first token's distribution moves with it (random weights: the text may not).
    first = [_first_logprobs(eng, t) for t in (tokens, other, eng.chat_prompt_tokens(_chat(None)))]
    assert len(set(first)) == 3, first
    assert _first_logprobs(eng, tokens) == first[0]


def _first_logprobs(eng: LlamaEngine, tokens: list[int]) -> tuple[tuple[str, float], ...]:
    params = replace(GREEDY, max_tokens=1, logprobs=5, cache_prompt=False)
    lp = next(lp for c in eng.generate(tokens, params, Cancel()) for lp in c.logprobs)
    return tuple((tok, round(v, 4)) for tok, v in lp.top)


def test_prefix_reuse_keeps_an_image_only_where_it_is_the_same(loaded: tuple[LlamaEngine, Plan, Any]) -> None:
    eng, _, _ = loaded
    first = eng.chat_prompt_tokens(_chat(_image(3)))
    start = next(i for i, t in enumerate(first) if t < 0)
    cold, _ = _run(eng, first, replace(GREEDY, cache_prompt=False))
    _run(eng, first)
    again, last = _run(eng, first)
    assert again == cold and last.cached_tokens > start  # the image's KV reused, the answer unchanged
    turn = [*_chat(_image(3)), {"role": "assistant", "content": again}, {"role": "user", "content": "And then?"}]
    t2 = eng.chat_prompt_tokens(turn)
    warm2, last2 = _run(eng, t2)
    cold2, _ = _run(eng, t2, replace(GREEDY, cache_prompt=False))
    assert warm2 == cold2 and last2.cached_tokens > start + 1
    swapped = eng.chat_prompt_tokens(_chat(_image(4)))
    warm3, last3 = _run(eng, swapped)
    cold3, _ = _run(eng, swapped, replace(GREEDY, cache_prompt=False))
    assert last3.cached_tokens <= start and warm3 == cold3


def test_two_images_and_several_sequences(loaded: tuple[LlamaEngine, Plan, Any]) -> None:
    eng, _, _ = loaded
    msgs = [{"role": "user", "content": [{"type": "image", "image": _image(5)}, {"type": "text", "text": "and"},
                                         {"type": "image", "image": _image(6, 16, 16)},
                                         {"type": "text", "text": "Compare them."}]}]
    tokens = eng.chat_prompt_tokens(msgs)
    assert len({t for t in tokens if t < 0}) == 2 * 16
    alone, _ = _run(eng, tokens, replace(GREEDY, cache_prompt=False))
    by: dict[int, str] = {}
    for c in eng.generate(tokens, replace(GREEDY, n=2, cache_prompt=False), Cancel()):
        by[c.index] = by.get(c.index, "") + c.text
    assert by == {0: alone, 1: alone}  # greedy choices fork from the prompt's KV, images included


def test_refusals(loaded: tuple[LlamaEngine, Plan, Any], embedded_model: str) -> None:
    eng, _, _ = loaded
    tokens = eng.chat_prompt_tokens(_chat(_image(7)))
    with pytest.raises(BadRequest, match="end with an image"):
        list(eng.generate(tokens[:next(i for i, t in enumerate(tokens) if t < 0) + 16], GREEDY, Cancel()))
    forged = [t if t >= 0 else -5 for t in tokens]
    with pytest.raises(BadRequest, match="does not have"):
        list(eng.generate(forged, GREEDY, Cancel()))
    plain = ServedModel.of(LlamaEngine())
    plain.load(embedded_model, _plan(embedded_model, None, slots=1))
    try:
        with pytest.raises(BadRequest, match="takes no images") as info:
            plain.chat_prompt_tokens(_chat(_image(1)))
        assert info.value.param == "messages[0].content[1]"
        with pytest.raises(BadRequest, match="takes no images"):
            list(plain.generate(tokens, GREEDY, Cancel()))
    finally:
        plain.unload()


def test_ngram_drafts_stop_before_an_image() -> None:
    run = image_run("00" * 16, 4)
    tokens = [5, 6, 7, *run, 8, 5, 6]
    assert NgramDrafter().draft(tokens, 7, 8) == []  # what followed "5 6 7" is an image: nothing to draft
    assert NgramDrafter().draft([5, 6, 7, 9, *run, 5, 6], 7, 8) == [9]
    assert len(set(run)) == 4 and all(t < 0 for t in run) and image_run("00" * 16, 4) == run


def test_projector_files_are_not_models(tmp_path: Path) -> None:
    from service.catalog.models import Registry
    from service.settings import Settings
    from sizing.testing.fixtures import TINY_LLAMA, write_fixture

    write_projector(tmp_path / "mmproj-tiny.gguf", TINY)
    write_fixture("model", tmp_path, shape=TINY_LLAMA)
    names = [e.name for e in Registry(Settings(models_dir=str(tmp_path))).list()]
    assert "model-bf16" in names and not any("mmproj" in n for n in names)


@pytest.fixture(scope="module")
def pixtral(embedded_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LlamaEngine, Plan, Any]]:
    from sizing.testing.projector_fixtures import TINY_PIXTRAL

    path = str(write_projector(tmp_path_factory.mktemp("pixtral") / "mmproj-pixtral-tiny.gguf", TINY_PIXTRAL,
                               values="random"))
    measured = {fa: measure_projector(path, fa) for fa in (True, False)}
    cap = measured[True].image_max_tokens
    figures = {("CPU", fa): mib_to_bytes(m.compute_mib["CPU"]) for fa, m in measured.items()}
    plan = _plan(embedded_model, Projector(probe_projector(path), figures=figures, image_max_tokens=cap), slots=1)
    eng = ServedModel.of(LlamaEngine())
    report = eng.load(embedded_model, plan)
    yield eng, plan, report
    eng.unload()


def test_a_dynamic_resolution_projector_takes_each_image_at_its_size_within_the_plans_cap(
        pixtral: tuple[LlamaEngine, Plan, Any]) -> None:
    eng, plan, report = pixtral
    pm = plan.estimate.projector
    # mtmd's own limit (512 px) is beyond its warmup (256 px): the plan caps an image at the warmup's 256 tokens.
    assert pm is not None and pm.tokens_per_image is None and pm.image_max_tokens == 256
    (alloc,) = report.projector_allocations
    assert abs(alloc.compute_bytes - pm.compute_bytes) <= 0.01 * MIB
    assert abs(alloc.weights_bytes - pm.weights_bytes) <= 0.01 * MIB

    def n_image(w: int, h: int) -> int:
        return sum(1 for t in eng.chat_prompt_tokens(_chat(_image(9, w, h))) if t < 0)

    small, wide, huge = n_image(64, 32), n_image(128, 64), n_image(1000, 1000)
    assert small < wide  # the tokens follow the image's size (a row break after each row of patches)
    assert huge <= 256 + 15  # resized within the cap: 16 x 16 patches and 15 row breaks at most
    text, last = _run(eng, eng.chat_prompt_tokens(_chat(_image(9, 1000, 1000))))
    assert last.completion_tokens > 0


def test_a_request_whose_image_was_dropped_meanwhile_has_it_prepared_again(loaded: tuple[LlamaEngine, Plan, Any]) -> None:
    """Many images tokenized between a prompt's tokenization and its generation (a queue of requests with images)
    drop its chunk from the few kept: the request carries its image, which is prepared again."""
    from service.engine.vision import KEEP

    eng, _, _ = loaded
    image = _image(20)
    tokens = eng.chat_prompt_tokens(_chat(image))
    cold, _ = _run(eng, tokens, replace(GREEDY, cache_prompt=False))
    for k in range(KEEP + 1):
        eng.chat_prompt_tokens(_chat(_image(100 + k)))
    with pytest.raises(BadRequest, match="does not have"):
        list(eng.generate(tokens, replace(GREEDY, cache_prompt=False), Cancel()))
    again, last = _run(eng, tokens, replace(GREEDY, cache_prompt=False, images=(image,)))
    assert again == cold and last.prompt_tokens == len(tokens)


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
          "{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")


def test_m_rope_images_take_fewer_positions_than_tokens(tmp_path: Path) -> None:
    """Qwen2-VL's M-RoPE (a tiny zero model and a Qwen2.5-VL tower of its width): an image of 4 x 2 merged patches
    takes 8 tokens but 4 positions (its grid's longer side), the text after it going on from there. The sequence's
    last position is its last token's index less 4, after a cold evaluation, after prefix reuse cut past the
    image and past a different one; a cut at a wrong position would leave stale cells llama.cpp refuses to
    continue ("inconsistent sequence positions")."""
    import llama_cpp

    from sizing.testing.fixtures import TINY_QWEN2VL, write_fixture
    from sizing.testing.projector_fixtures import TINY_QWEN25VL

    model = write_fixture("tiny-qwen2vl", tmp_path, shape=TINY_QWEN2VL)
    proj = write_projector(tmp_path / "mmproj-tiny-qwen25vl.gguf", TINY_QWEN25VL)
    plan = make_plan(probe_path(model), [], host_memory(),
                     PlanRequest(n_ctx=2048, n_seq_max=1, min_ctx=256, cpu_repack=False,
                                 projector=Projector(probe_projector(str(proj)))))
    eng = ServedModel.of(LlamaEngine(), chat_template=CHATML)
    eng.load(model, plan)
    try:
        def chat(image: ImageInput, text: str) -> list[int]:
            return eng.chat_prompt_tokens([{"role": "user", "content": [
                {"type": "text", "text": "Look:"}, {"type": "image", "image": image}, {"type": "text", "text": text}]}])

        def last_pos() -> int:
            return int(llama_cpp.llama_memory_seq_pos_max(eng.engine.loaded.mem, 0))

        one = replace(GREEDY, max_tokens=1)
        a = chat(_image(1, 100, 60), "What is it?")
        assert sum(1 for t in a if t < 0) == 8
        _run(eng, a, replace(one, cache_prompt=False))
        assert last_pos() == len(a) - 1 - 4
        b = chat(_image(1, 100, 60), "And what colour is it, would you say?")
        _, last = _run(eng, b, one)
        assert last.cached_tokens > next(i for i, t in enumerate(b) if t < 0) + 8  # reused past the image
        assert last_pos() == len(b) - 1 - 4
        c = chat(_image(2, 100, 60), "What is it?")
        _, last = _run(eng, c, one)
        assert last.cached_tokens <= next(i for i, t in enumerate(c) if t < 0)  # another image: cut before it
        assert last_pos() == len(c) - 1 - 4
        text, last = _run(eng, c, replace(GREEDY, max_tokens=6))
        assert last.completion_tokens == 6 and last_pos() == len(c) - 1 - 4 + 5
    finally:
        eng.unload()
