"""Token ids to text for a response: incremental decoding and stop strings cut as OpenAI cuts them (the output
ends just before the first occurrence of any stop string, which is not returned).

Incremental, as vLLM's detokenizer and transformers' TextStreamer are: each new token decodes a short window of
recent tokens (`prefix` .. end) and what that window adds beyond its first part (`prefix` .. `read`) is the new
text, so a token costs the same at the 10th and the 10,000th position. A window that ends in the replacement
character (an incomplete UTF-8 sequence) waits for the next token. Stop strings are searched only in the text not
yet sent: text is sent once it cannot be the start of a stop string."""


class TextStream:
    """Feed tokens with `add` (returns the text that is safe to send now); `stopped` turns True at a stop string.
    Text that could still become a stop string, or an incomplete UTF-8 sequence, is held back until it cannot."""

    def __init__(self, tok, stop: list[str]):
        self.tok, self.stop = tok, [s for s in stop if s]
        self.ids: list[int] = []
        self.prefix = self.read = 0      # the window: ids[prefix:read] is decoded text, ids[read:] is not yet
        self.sent: list[str] = []        # pieces returned so far
        self.held = ""                   # decoded text not returned yet (a possible stop string's start)
        self.stopped = False
        self.tokens = 0                  # tokens consumed, up to and including the one that completed a stop string

    @property
    def text(self) -> str:
        """The text returned so far (at a stop string: all of it, cut before the stop)."""
        return "".join(self.sent)

    def _decode_new(self) -> str:
        """The text the tokens after `read` add ("" while they end inside a UTF-8 character)."""
        window = self.tok.decode(self.ids[self.prefix:])
        if window.endswith("\ufffd"):
            return ""
        before = self.tok.decode(self.ids[self.prefix:self.read]) if self.read > self.prefix else ""
        self.prefix, self.read = self.read, len(self.ids)
        return window[len(before):]

    def add(self, token: int) -> str:
        if self.stopped:
            return ""
        self.tokens += 1
        self.ids.append(token)
        new = self._decode_new()
        if not new:
            return ""
        text = self.held + new
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self.held = ""
            return self._send(text[:cut])
        hold = max((k for s in self.stop for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)
        self.held = text[len(text) - hold:]
        return self._send(text[:len(text) - hold])

    def _send(self, piece: str) -> str:
        if piece:
            self.sent.append(piece)
        return piece

    def finish(self) -> str:
        """The text still held back (at the end of the generation), an unfinished UTF-8 sequence as U+FFFD."""
        if self.stopped:
            return ""
        tail = self.tok.decode(self.ids[self.prefix:])
        before = self.tok.decode(self.ids[self.prefix:self.read]) if self.read > self.prefix else ""
        self.prefix = self.read = len(self.ids)
        piece, self.held = self.held + tail[len(before):], ""
        return self._send(piece)


def token_text(tok, t: int) -> tuple[str, bytes | None]:
    """(the text of token `t` for a logprobs entry, its bytes). A token that is part of a UTF-8 character has no
    text of its own: OpenAI writes it "bytes:\\xe2\\x80" (its bytes known: the byte tokenizer), vLLM "token_id:N"
    (otherwise), so that different tokens never share a key of `top_logprobs`."""
    s = tok.decode([t])
    if "\ufffd" not in s:
        return s, s.encode()
    if getattr(tok, "kind", None) == "byte" and 0 <= t < 256:
        return f"bytes:\\x{t:02x}", bytes([t])
    return f"token_id:{t}", None
