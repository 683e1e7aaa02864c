"""Request bodies: parsed with pydantic (types), checked here (limits), turned into a ``Request``.

Ranges of the sampling knobs are checked by ``runtime.sampling.Sampling``, the same
checks ``generate`` runs; the length limits (body, prompt, max_tokens, context) live here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from ..runtime.sampling import Sampling
from .errors import APIError


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI fields we do not use (user, logit_bias...)

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
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_Part] | None = None

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
    try:
        body = (ChatBody if chat else CompletionBody).model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or None
        raise APIError(400, f"{field}: {first['msg']}", param=field) from None
    if body.n != 1:
        raise APIError(400, f"n must be 1 (one answer per request), got {body.n}", param="n")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    try:
        how = Sampling(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed,
                       stop=tuple(stops))
    except ValueError as err:
        raise APIError(400, str(err)) from None
    limit = body.max_completion_tokens if chat and body.max_completion_tokens is not None else body.max_tokens
    if limit is not None and limit < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {limit}", param="max_tokens")
    return Request(chat, _prompt(body, chat), limit, how, body.stream,
                   bool(body.stream_options and body.stream_options.include_usage), body.model)


def _prompt(body, chat: bool):
    if chat:
        if not body.messages:
            raise APIError(400, "messages must hold at least one message", param="messages")
        return [{"role": m.role, "content": m.text()} for m in body.messages]
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise APIError(400, "prompt must be one string (batches of prompts are not supported)",
                           param="prompt")
        prompt = prompt[0]
    return prompt


def budget(prompt_tokens: int, asked: int | None, *, context: int | None, max_prompt: int | None,
           max_tokens: int) -> int:
    """New tokens to generate: what was asked, within the server's limits and the context."""
    if max_prompt is not None and prompt_tokens > max_prompt:
        raise APIError(400, f"the prompt has {prompt_tokens} tokens; this server takes at most {max_prompt}",
                       code="context_length_exceeded", param="messages")
    room = max_tokens if context is None else min(max_tokens, context - prompt_tokens)
    if room < 1:
        raise APIError(400, f"the prompt has {prompt_tokens} tokens and fills the model's context of "
                            f"{context}; shorten it", code="context_length_exceeded", param="messages")
    if asked is None:
        return room
    if asked > max_tokens:
        raise APIError(400, f"max_tokens is {asked}; this server allows at most {max_tokens}",
                       param="max_tokens")
    if context is not None and prompt_tokens + asked > context:
        raise APIError(400, f"the prompt's {prompt_tokens} tokens plus max_tokens {asked} exceed the "
                            f"model's context of {context}; ask for at most {context - prompt_tokens}",
                       code="context_length_exceeded", param="max_tokens")
    return asked
