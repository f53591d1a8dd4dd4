"""Forced tool calls through the official clients, on a service as `make run` starts it (issue 45).

    .venv/bin/python bench/tool_calls_check.py                     # starts the service on its defaults
    .venv/bin/python bench/tool_calls_check.py --url http://127.0.0.1:8000   # a running `make run`
    .venv/bin/python bench/tool_calls_check.py --parallel true     # what a client asking for parallel calls gets

For each ``max_tokens`` (48, 56, 64 by default), a forced call (``tool_choice`` required and named) of a two-argument
tool (a city, a number of days) through:

- the ``openai`` client's chat completions, whole and streamed (the stream must reassemble to the whole answer);
- openai-agents' default model (``OpenAIResponsesModel``, the Responses API): a one-tool agent whose run ends with
  the tool's result (``stop_on_first_tool``);
- the ``anthropic`` client's Messages API (``tool_choice`` any and tool).

A check passes when the answer ends with a whole call (``tool_calls`` / ``tool_use`` / the agent's output) whose
arguments parse and match the tool's schema. Printed: one line per check with its finish and arguments, then the
count. Exit status 1 when any failed. A check, not a benchmark: it prints no timings.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from typing import Any, Iterator

from harness import run_service

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city", "days"]}
TOOL = {"type": "function", "function": {"name": "get_forecast", "description": "The weather forecast of a city",
                                          "parameters": PARAMS}}
ASK = "What will the weather be in Paris for the next 3 days?"


@contextlib.contextmanager
def served(url: str | None) -> Iterator[str]:
    """``url``, or ``python -m service`` on its defaults (a models folder of its own) until the checks end."""
    if url:
        yield url.rstrip("/")
        return
    with run_service() as url:
        yield url


def valid(arguments: Any) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(arguments) if isinstance(arguments, str) else arguments, PARAMS)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def openai_checks(url: str, model: str, max_tokens: int, extra: dict[str, Any]) -> list[tuple[str, bool, str]]:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    out = []
    for label, choice in (("required", "required"),
                          ("named", {"type": "function", "function": {"name": "get_forecast"}})):
        kw: dict[str, Any] = dict(model=model, messages=[{"role": "user", "content": ASK}], tools=[TOOL],
                                  tool_choice=choice, max_tokens=max_tokens, temperature=0, extra_body=extra)
        whole = client.chat.completions.create(**kw).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
        streamed: dict[int, list[str]] = {}
        finish = None
        for ev in client.chat.completions.create(stream=True, **kw):
            for ch in ev.choices:
                finish = ch.finish_reason or finish
                for d in ch.delta.tool_calls or []:
                    piece = streamed.setdefault(d.index, ["", ""])
                    piece[0] += (d.function.name or "") if d.function else ""
                    piece[1] += (d.function.arguments or "") if d.function else ""
        same = [tuple(v) for _, v in sorted(streamed.items())] == calls and finish == whole.finish_reason
        ok = whole.finish_reason == "tool_calls" and bool(calls) and all(valid(a) for _, a in calls) and same
        out.append((f"openai chat, {label}", ok, f"{whole.finish_reason}: {calls}"
                    + ("" if same else f"; streamed {finish}: {streamed}")))
    client.close()
    return out


def agents_check(url: str, model: str, max_tokens: int, extra: dict[str, Any]) -> tuple[str, bool, str]:
    import agents
    import openai

    called: list[dict[str, Any]] = []

    @agents.function_tool
    def get_forecast(city: str, days: int) -> str:
        """The weather forecast of a city."""
        called.append({"city": city, "days": days})
        return f"sunny in {city} for {days} days"

    async def run() -> tuple[bool, str]:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        agents.set_tracing_disabled(True)
        settings = agents.ModelSettings(max_tokens=max_tokens, temperature=0, tool_choice="required",
                                        extra_body=extra or None)
        agent = agents.Agent(name="forecaster", instructions="Use the tool.", tools=[get_forecast],
                             model=agents.OpenAIResponsesModel(model, client), model_settings=settings,
                             tool_use_behavior="stop_on_first_tool")
        try:
            result = await agents.Runner.run(agent, ASK)
        except Exception as exc:  # what the agent's user sees: the check fails with it
            return False, f"{type(exc).__name__}: {str(exc)[:200]}"
        finally:
            await client.close()
        return bool(called) and str(result.final_output).startswith("sunny in"), f"{called}: {result.final_output}"

    ok, said = asyncio.run(run())
    return "openai-agents, Responses model", ok, said


def anthropic_checks(url: str, model: str, max_tokens: int, extra: dict[str, Any]) -> list[tuple[str, bool, str]]:
    import anthropic

    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=300)
    tool = {"name": "get_forecast", "description": "The weather forecast of a city", "input_schema": PARAMS}
    out = []
    for label, choice in (("any", {"type": "any"}), ("tool", {"type": "tool", "name": "get_forecast"})):
        if extra.get("parallel_tool_calls") is False:
            choice = {**choice, "disable_parallel_tool_use": True}
        msg = client.messages.create(model=model, max_tokens=max_tokens, tools=[tool], tool_choice=choice,
                                     messages=[{"role": "user", "content": ASK}], extra_body={"temperature": 0})
        uses = [b.input for b in msg.content if b.type == "tool_use"]
        ok = msg.stop_reason == "tool_use" and bool(uses) and all(valid(u) for u in uses)
        out.append((f"anthropic messages, {label}", ok, f"{msg.stop_reason}: {uses}"))
    client.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running service (default: start one on its defaults)")
    ap.add_argument("--model", help="the model's name (default: the service's first)")
    ap.add_argument("--max-tokens", default="48,56,64")
    ap.add_argument("--parallel", choices=("default", "true", "false"), default="default",
                    help="parallel_tool_calls as the clients send it (default: not sent)")
    args = ap.parse_args()
    import httpx

    extra: dict[str, Any] = {} if args.parallel == "default" else {"parallel_tool_calls": args.parallel == "true"}
    failed = 0
    with served(args.url) as url:
        model = args.model or httpx.get(url + "/v1/models", timeout=60).json()["data"][0]["id"]
        print(f"model {model} at {url}; parallel_tool_calls {args.parallel}")
        for m in (int(x) for x in args.max_tokens.split(",")):
            rows = [*openai_checks(url, model, m, extra), agents_check(url, model, m, extra),
                    *anthropic_checks(url, model, m, extra)]
            for label, ok, said in rows:
                failed += not ok
                print(f"max_tokens {m:3d}  {'pass' if ok else 'FAIL'}  {label:34s} {said[:160]}")
    print(f"{failed} failed" if failed else "all passed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
