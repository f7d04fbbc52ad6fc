"""``radixkv serve``: an OpenAI-compatible server on the prefix-cached Engine.

```text
cmd           the command line (loading: the engine; ranks: tensor-parallel ranks; config)
app           the HTTP routes: each parses, builds a Completion (or answers) and returns
completion    one request's way through the engine: checks, submit, collect / stream
openai        OpenAI's request bodies, error object, replies and chunks (pure builders)
engine_loop   the thread that steps the engine, requests in flight, the queue's bound
responses     OpenAI's Responses API  ┐ translated onto a chat Completion
messages      Anthropic's Messages API┘ (chat_bridge)
chat_prompt, content_parts, structured, tool_calls, request_fields, prompt_cache,
token_bytes   how a request is read: template, parts, grammars, tool calls, fields, retention
```
"""
