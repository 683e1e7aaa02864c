"""Request bodies: parsed with pydantic (types), checked here (limits), turned into a ``Request``.

Ranges of the sampling knobs are checked by ``runtime.sampling.Sampling``, the same
checks ``generate`` runs; the length limits (body, prompt, max_tokens, context) live here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from ..runtime.generate import ContextError, check_context
from ..runtime.sampling import Sampling
from .errors import APIError


class StreamOptions(BaseModel):
    include_usage: bool = False


# OpenAI parameters this server does not implement, with the values that ask for nothing (what
# many clients send by default): those pass, anything else is a 400 naming the parameter. A field
# in neither table nor the body classes is unknown: also a 400, never silently ignored.
NEUTRAL: dict[str, tuple] = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}),
    "tools": (None, []), "tool_choice": (None, "none"), "parallel_tool_calls": (None, True, False),
    "functions": (None, []), "function_call": (None, "none"), "suffix": (None, ""),
    "response_format": (None, {"type": "text"}),
}
IGNORED = ("user",)  # OpenAI's end-user id for abuse monitoring: nothing to do here


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")  # unknown fields: 400 (see NEUTRAL)

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0      # OpenAI's default: sampled unless the client asks for 0
    top_p: float = 1.0
    top_k: int = 0                # not OpenAI's; vLLM and llama.cpp take it too (extra_body)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1


class _Part(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")  # e.g. 'name': the template decides what it shows
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_Part] | None = None  # None is refused in _prompt, naming the message

    def text(self) -> str:
        if isinstance(self.content, list):
            if any(p.type != "text" for p in self.content):
                raise APIError(400, "only text content parts are supported", param="messages")
            return "".join(p.text or "" for p in self.content)
        return self.content or ""


class ChatBody(_Body):
    messages: list[Message]
    max_completion_tokens: int | None = None


class CompletionBody(_Body):
    prompt: str | list[str]


@dataclass
class Request:
    """What the worker needs, after every check."""

    chat: bool
    prompt: object                # text, or chat messages [{role, content}]
    max_tokens: int | None
    sampling: Sampling
    stream: bool
    include_usage: bool
    model: str


def parse(raw: bytes, chat: bool) -> Request:
    """A request body -> Request; any problem is a 400 APIError naming the field."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise APIError(400, f"the body is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object")
    data = _supported(data)
    try:
        body = (ChatBody if chat else CompletionBody).model_validate(data)
    except ValidationError as err:
        raise _validation_error(err) from None
    if body.n != 1:
        raise APIError(400, f"n must be 1 (one answer per request), got {body.n}", param="n")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    try:
        how = Sampling(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed,
                       stop=tuple(stops))
    except ValueError as err:  # Sampling's messages start with the field they are about
        field = str(err).split(" ", 1)[0]
        raise APIError(400, str(err), param=field if field in _SAMPLING_FIELDS else None) from None
    limit = body.max_completion_tokens if chat and body.max_completion_tokens is not None else body.max_tokens
    if limit is not None and limit < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {limit}", param="max_tokens")
    return Request(chat, _prompt(body, chat), limit, how, body.stream,
                   bool(body.stream_options and body.stream_options.include_usage), body.model)


_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "stop")


def _supported(data: dict) -> dict:
    """``data`` without the parameters that ask for nothing; a 400 for one that asks for
    something this server does not do."""
    out = {}
    for key, value in data.items():
        if key in NEUTRAL:
            if not any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in NEUTRAL[key]):
                raise APIError(400, f"{key} is not supported by this server (got {json.dumps(value)}); "
                                    "leave it out", code="unsupported_parameter", param=key)
        elif key not in IGNORED:
            out[key] = value
    return out


def _validation_error(err: ValidationError) -> APIError:
    first = err.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or None
    if first["type"] == "extra_forbidden":
        return APIError(400, f"unknown parameter {field!r}", code="unknown_parameter", param=field)
    return APIError(400, f"{field}: {first['msg']}", param=field)


def _prompt(body, chat: bool):
    if chat:
        if not body.messages:
            raise APIError(400, "messages must hold at least one message", param="messages")
        for i, m in enumerate(body.messages):
            if m.content is None:  # OpenAI's null content goes with tool calls, which are not made here
                raise APIError(400, f"messages.{i}.content is missing or null; send the message's text",
                               param=f"messages.{i}.content")
        return [{"role": m.role, "content": m.text()} for m in body.messages]
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise APIError(400, "prompt must be one string (batches of prompts are not supported)",
                           param="prompt")
        prompt = prompt[0]
    return prompt


def budget(prompt_tokens: int, asked: int | None, *, context: int | None, max_prompt: int | None,
           max_tokens: int, prompt_param: str = "messages") -> int:
    """New tokens to generate: what was asked, within the server's limits and the context (the
    context rule is ``generate``'s own, ``runtime.generate.check_context``). ``prompt_param``:
    the field that holds the prompt ('messages' for chat, 'prompt' for completions)."""
    if max_prompt is not None and prompt_tokens > max_prompt:
        raise APIError(400, f"the prompt has {prompt_tokens} tokens; this server takes at most {max_prompt}",
                       code="context_length_exceeded", param=prompt_param)
    if asked is not None and asked > max_tokens:
        raise APIError(400, f"max_tokens is {asked}; this server allows at most {max_tokens}",
                       param="max_tokens")
    room = max_tokens if context is None else max(min(max_tokens, context - prompt_tokens), 1)
    try:
        check_context(prompt_tokens, room if asked is None else asked, context)
    except ContextError as err:
        raise APIError(400, str(err), code="context_length_exceeded",
                       param=prompt_param if err.param == "prompt" else err.param) from None
    return room if asked is None else asked
