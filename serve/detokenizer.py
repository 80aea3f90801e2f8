"""Incremental detokenization with stop strings: the server's side of stopping.

Text is released only when it is final: never the tail of an incomplete UTF-8 character
(decoded as U+FFFD), and never text that could still turn out to be the start of a stop
string (the last len(longest stop) - 1 characters wait until the next tokens or the end).
At the end, a character the last tokens left incomplete (an answer cut at max_tokens) is
dropped, not sent as U+FFFD (`TextTokenizer.decode_complete`). The matched stop string is
not part of the output (OpenAI's behaviour).
"""

from __future__ import annotations

from typing import Sequence


class IncrementalDetokenizer:
    """Token ids in, final text out. Each step decodes only a window of the last tokens
    (text-generation-inference's prefix/read offsets), not the whole output again: the
    window starts at a character boundary, so the pieces join into decode(all ids)."""

    def __init__(self, tokenizer, *, stop: Sequence[str] = (),
                 stop_token_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.stop_token_ids = frozenset(stop_token_ids)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids[prefix_offset:read_offset] decoded last time
        self.read_offset = 0
        self.decoded = ""       # decode(ids[:read_offset])
        self.text = ""          # the text returned so far (cut before a stop string)
        self.sent = 0
        self.stopped = False    # a stop string matched: the request should end

    def _advance(self, last: bool) -> str:
        """decode(ids[:read_offset]) grown by whatever ends on a character boundary (all of
        it when `last`)."""
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix_offset:self.read_offset])
        now = (self.tokenizer.decode_complete if last else decode)(self.ids[self.prefix_offset:])
        if len(now) > len(before) and (last or not now.endswith("\ufffd")):
            self.decoded += now[len(before):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self.decoded

    def add(self, token_ids: Sequence[int], *, last: bool = False) -> str:
        """Take new token ids; return the text that became final. `last`: no more tokens
        come, so everything held back is released."""
        if self.stopped:
            return ""
        new = list(token_ids)
        if new and new[-1] in self.stop_token_ids:  # the stop token ends it and is no text
            new = new[:-1]
        self.ids.extend(new)
        full = self._advance(last)
        if self.stop:
            # Text before `sent - hold` was searched already and holds no whole stop string.
            start = max(0, self.sent - self.hold)
            found = [i for s in self.stop if (i := full.find(s, start)) >= 0]
            if found:
                full = full[:min(found)]
                self.stopped = last = True
        end = len(full) if last else max(self.sent, len(full) - self.hold)
        piece = full[self.sent:end]
        self.sent, self.text = end, full[:end]
        return piece
