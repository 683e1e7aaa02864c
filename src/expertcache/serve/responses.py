"""OpenAI response bodies and stream chunks for chat and text completions."""

from __future__ import annotations

import json
import time
import uuid

from ..runtime.generate import Generation
from .telemetry import usage_block


class Shape:
    """Ids, timestamps and field names of one answer (chat or text completion)."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, gen: Generation) -> dict:
        reason = finish_reason(gen)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": gen.text}, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": gen.text, "logprobs": None, "finish_reason": reason}
        return {**self._head("chat.completion" if self.chat else "text_completion"),
                "choices": [choice], "usage": usage(gen)}

    def chunk(self, text: str | None = None, reason: str | None = None, role: bool = False) -> str:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": reason}
            return sse({**self._head("chat.completion.chunk"), "choices": [choice]})
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        return sse({**self._head("text_completion"), "choices": [choice]})

    def usage_chunk(self, gen: Generation) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return sse({**self._head(obj), "choices": [], "usage": usage(gen)})


def usage(gen: Generation) -> dict:
    done = len(gen.token_ids)
    return {"prompt_tokens": gen.prompt_tokens, "completion_tokens": done,
            "total_tokens": gen.prompt_tokens + done, "expertcache": usage_block(gen.summary)}


def finish_reason(gen: Generation) -> str:
    """OpenAI's reasons: a cut-short answer (its client left) reads as 'length'."""
    return "length" if gen.finish_reason == "cancelled" else gen.finish_reason


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


DONE = "data: [DONE]\n\n"
