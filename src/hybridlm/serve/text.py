"""Token ids to text for a response: incremental decoding and stop strings cut as OpenAI cuts them (the output
ends just before the first occurrence of any stop string, which is not returned)."""


class TextStream:
    """Feed tokens with `add` (returns the text that is safe to send now); `stopped` turns True at a stop string.
    Text that could still become a stop string, or an incomplete UTF-8 sequence, is held back until it cannot."""

    def __init__(self, tok, stop: list[str]):
        self.tok, self.stop = tok, [s for s in stop if s]
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0              # characters of `text` already returned
        self.stopped = False
        self.tokens = 0            # tokens consumed, up to and including the one that completed a stop string

    def add(self, token: int) -> str:
        if self.stopped:
            return ""
        self.tokens += 1
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):            # the middle of a UTF-8 sequence
            return ""
        self.text = text
        cut = min((i for i in (text.find(s, max(0, self.sent - len(s) + 1)) for s in self.stop) if i >= 0),
                  default=-1)
        if cut >= 0:
            self.stopped = True
            self.text = text[:cut]
            return self._flush(cut)
        hold = max((k for s in self.stop for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)
        return self._flush(len(text) - hold)

    def _flush(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out = self.text[self.sent:upto]
        self.sent = upto
        return out

    def finish(self) -> str:
        """The text still held back (at the end of the generation)."""
        if not self.stopped and self.ids:
            self.text = self.tok.decode(self.ids)
        return self._flush(len(self.text))
