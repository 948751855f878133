"""A full tool loop in a real agent framework: the OpenAI Agents SDK against the live server on the default model,
through its chat-completions model and through its default model, on the Responses API (``/v1/responses``): a
tool call, the tool's result sent back, and an answer in text."""

from __future__ import annotations

import asyncio

import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

from tests.e2e.conftest import API_KEY

pytestmark = pytest.mark.real_model
MODEL = "SmolLM2-135M-Instruct"


def weather_caller(server, model_class: type) -> tuple[Agent, list[str]]:
    """An agent on ``model_class`` (the chat or the Responses model) against ``server`` that must call its one tool,
    ``get_weather``, and stops on its result; and the list of cities the tool was asked about."""
    set_tracing_disabled(True)  # nothing leaves the machine
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        asked.append(city)
        return f"Sunny, 21 degrees Celsius in {city}."

    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    caller = Agent(
        name="weather",
        instructions="Answer questions about the weather. Call get_weather first, then answer in one sentence.",
        tools=[get_weather],
        model=model_class(model=MODEL, openai_client=client),
        model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=48),
        tool_use_behavior="stop_on_first_tool",
    )
    return caller, asked


def test_an_agent_calls_a_tool_and_answers_with_its_result(server):
    caller, asked = weather_caller(server, OpenAIChatCompletionsModel)
    called = Runner.run_sync(caller, "What is the weather in Paris?", max_turns=2)
    assert asked and all(isinstance(city, str) and city for city in asked)
    assert called.final_output == f"Sunny, 21 degrees Celsius in {asked[0]}."
    # The 135M model, left on `auto` after a call, imitates its own call again (docs/design.md, "Tool calls"): the
    # answering turn asks for text. Its input is the SDK's own history: the call and the tool's result.
    answerer = caller.clone(model_settings=ModelSettings(tool_choice="none", temperature=0, max_tokens=48),
                            tool_use_behavior="run_llm_again")
    answered = Runner.run_sync(answerer, called.to_input_list(), max_turns=2)
    assert isinstance(answered.final_output, str) and answered.final_output.strip()
    assert [item.type for item in answered.new_items] == ["message_output_item"]
    kinds = [entry.get("type", entry.get("role")) for entry in called.to_input_list()]
    assert kinds == ["user", "function_call", "function_call_output"]


def test_an_agent_on_the_responses_api_calls_a_tool_and_answers(server):
    """The Agents SDK's default model class, ``OpenAIResponsesModel``: the same loop over ``/v1/responses``."""
    caller, asked = weather_caller(server, OpenAIResponsesModel)
    called = Runner.run_sync(caller, "What is the weather in Paris?", max_turns=2)
    assert asked and all(isinstance(city, str) and city for city in asked)
    assert called.final_output == f"Sunny, 21 degrees Celsius in {asked[0]}."
    [response] = called.raw_responses
    assert response.response_id.startswith("resp_")  # it came from /v1/responses

    # This model class raises on an incomplete response (max_output_tokens reached): the answer gets room to end.
    answerer = caller.clone(model_settings=ModelSettings(tool_choice="none", temperature=0, max_tokens=128),
                            tool_use_behavior="run_llm_again")
    answered = Runner.run_sync(answerer, called.to_input_list(), max_turns=2)
    assert isinstance(answered.final_output, str) and answered.final_output.strip()
    assert [item.type for item in answered.new_items] == ["message_output_item"]
    kinds = [entry.get("type", entry.get("role")) for entry in called.to_input_list()]
    assert kinds == ["user", "function_call", "function_call_output"]

    async def streamed() -> tuple[object, list[str]]:
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
        agent = caller.clone(model=OpenAIResponsesModel(model=MODEL, openai_client=client))  # a client of this loop
        run = Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=2)
        kinds = [event.data.type async for event in run.stream_events() if event.type == "raw_response_event"]
        return run.final_output, kinds

    final, kinds = asyncio.run(streamed())  # the first turn again, over the event stream (last: a new loop)
    assert final == called.final_output and kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
