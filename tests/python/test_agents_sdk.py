"""The official OpenAI Agents SDK (`openai-agents`) against the real server, on the Responses API and on
chat completions: an agent calls a function tool (the SDK marks it `strict`), gets its result back in the
next turn and answers; the same run streamed; an agent's `output_type` read from a JSON answer; and an
`output_type` sent beside a forced first turn (`tool_choice: required`), which is a call."""

import asyncio

import pytest
from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
                    function_tool, set_tracing_disabled)
from agents.exceptions import MaxTurnsExceeded
from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem
from openai import AsyncOpenAI
from pydantic import BaseModel

from conftest import KuraServer

set_tracing_disabled(True)


@pytest.fixture(scope="module")
def srv():
    s = KuraServer("--kv-cache-memory", "256MiB")
    yield s
    s.stop()


class Report(BaseModel):
    city: str
    degrees: int


def weather_tool(calls: list[str]):
    @function_tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        calls.append(city)
        return f"It is 21 degrees and sunny in {city}."

    return get_weather


def model_of(srv: KuraServer, api: str):
    client = AsyncOpenAI(base_url=srv.url + "/v1", api_key=srv.api_key, max_retries=0)
    if api == "responses":
        return OpenAIResponsesModel(model=srv.model(), openai_client=client)
    return OpenAIChatCompletionsModel(model=srv.model(), openai_client=client)


# Greedy, one call a turn; the SDK sets tool_choice back to auto once the tool has run.
FORCED = ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=100)


def kinds(items) -> list[str]:
    return [type(i).__name__ for i in items]


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_an_agent_calls_its_tool_gets_the_result_and_answers(srv, api):
    calls: list[str] = []
    agent = Agent(name="weather", instructions="Answer weather questions with the tool.",
                  tools=[weather_tool(calls)], model=model_of(srv, api), model_settings=FORCED)
    result = asyncio.run(Runner.run(agent, "Weather in Oslo?", max_turns=3))
    # One call (its arguments the tool's schema: a city), its output sent back, then an answer.
    assert len(calls) == 1 and calls[0], calls
    assert kinds(result.new_items) == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"], result.new_items
    call, output = result.new_items[0], result.new_items[1]
    assert isinstance(call, ToolCallItem) and isinstance(output, ToolCallOutputItem)
    assert output.raw_item["call_id"] == call.raw_item.call_id
    assert isinstance(result.new_items[2], MessageOutputItem)
    assert isinstance(result.final_output, str) and result.final_output

    # Streamed, the same greedy run: the same items and answer, as events while it runs. (A client
    # belongs to the event loop it ran in: a new one.)
    streamed_calls: list[str] = []
    agent = agent.clone(tools=[weather_tool(streamed_calls)], model=model_of(srv, api))

    async def run_streamed():
        run = Runner.run_streamed(agent, "Weather in Oslo?", max_turns=3)
        events = [e.type async for e in run.stream_events()]
        return run, events

    run, events = asyncio.run(run_streamed())
    assert {"raw_response_event", "run_item_stream_event"} <= set(events), set(events)
    assert streamed_calls == calls
    assert kinds(run.new_items) == kinds(result.new_items)
    assert run.final_output == result.final_output


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_an_agents_output_type_is_read_from_its_answer(srv, api):
    agent = Agent(name="reporter", instructions="Report the weather of the city as JSON.", output_type=Report,
                  model=model_of(srv, api), model_settings=ModelSettings(temperature=0, max_tokens=60))
    result = asyncio.run(Runner.run(agent, "Oslo, 21 degrees.", max_turns=1))
    # The SDK asked for a strict JSON schema; what it parsed is a Report.
    assert isinstance(result.final_output, Report), result.final_output


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_an_output_type_beside_a_forced_first_turn_gives_the_call(srv, api):
    calls: list[str] = []
    agent = Agent(name="weather", instructions="Answer weather questions with the tool.",
                  tools=[weather_tool(calls)], output_type=Report, model=model_of(srv, api), model_settings=FORCED)
    # One turn: the forced call (the format is for a later turn's text), run, then out of turns.
    with pytest.raises(MaxTurnsExceeded) as e:
        asyncio.run(Runner.run(agent, "Weather in Oslo?", max_turns=1))
    assert len(calls) == 1 and calls[0], calls
    assert kinds(e.value.run_data.new_items) == ["ToolCallItem", "ToolCallOutputItem"]
