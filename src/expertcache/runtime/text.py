"""Token ids -> text deltas as they are generated, cut at stop strings.

Decoding each new token alone breaks words and multi-byte characters, and decoding the
whole text again per token costs O(n^2); so (as TGI and vLLM do) a short window of
ids is decoded twice and only the text it adds is emitted, once it does not end in an
unfinished character. Text that could be the start of a stop string is held back until
it is known not to be one, so a stop string never reaches the client.
"""

from __future__ import annotations


class StreamText:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.ids: list[int] = []
        self._prefix = self._read = 0   # window of ids already turned into text
        self._text = ""                 # decoded so far (maybe holding a stop-string prefix)
        self._sent = 0                  # characters of _text already returned
        self.stopped = False            # a stop string was found

    def add(self, token_ids) -> str:
        """Take new token ids; returns the text that is now final (may be '')."""
        if self.stopped:
            return ""
        self.ids.extend(int(t) for t in token_ids)
        before = self._decode(self._prefix, self._read)
        after = self._decode(self._prefix, len(self.ids))
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._text += after[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
        return self._release()

    def finish(self) -> str:
        """The end of generation: whatever was held back is final now."""
        if not self.stopped:
            tail = self._decode(self._prefix, len(self.ids))[len(self._decode(self._prefix, self._read)):]
            self._text += tail
            self._read = len(self.ids)
        return self._release(final=True)

    @property
    def text(self) -> str:
        return self._text[:self._sent]

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=True) if end > start else ""

    def _release(self, final: bool = False) -> str:
        cut = self._find_stop()
        if cut is not None:
            self.stopped, self._text = True, self._text[:cut]
            end = cut
        else:
            end = len(self._text) if final else len(self._text) - self._held()
        out, self._sent = self._text[self._sent:end], max(self._sent, end)
        return out

    def _find_stop(self) -> int | None:
        start = max(0, self._sent - max((len(s) for s in self.stop), default=0))
        hits = [i for i in (self._text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _held(self) -> int:
        """Length of the longest end of the text that begins some stop string."""
        for n in range(min(len(self._text), max((len(s) for s in self.stop), default=0)), 0, -1):
            if any(s.startswith(self._text[-n:]) for s in self.stop):
                return n
        return 0
