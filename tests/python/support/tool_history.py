"""An agent's conversation after one tool call and its result, in OpenAI's shape (the call's
arguments a JSON string, the assistant's content null), with its tool and the Hermes/Qwen-style
chat template that renders tools and calls: what the chat-rendering tests of the library and
the server share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: A chat template that renders ``tools`` and assistant ``tool_calls`` (``arguments | tojson``),
#: as Qwen 2.5's and Hermes 2 Pro's do.
TEMPLATE = (Path(__file__).parent / "templates" / "hermes_tools.jinja").read_text()

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

#: What the server generated for the call, as an OpenAI client sends it back: the arguments a
#: JSON string (with a non-ASCII character and spacing of its own), the content null.
ARGUMENTS = '{"city":  "Zürich"}'


def agent_history(arguments: Any = ARGUMENTS) -> list[dict[str, Any]]:
    """An agent's conversation after one call (with ``arguments``) and its result."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather"}}
    call["function"]["arguments"] = arguments
    return [
        {"role": "user", "content": "What is the weather in Zürich?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 degrees."},
    ]
