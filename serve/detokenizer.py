"""Incremental detokenization with stop strings: the server's side of stopping.

Text is released only when it is final: never the tail of an incomplete UTF-8 character
(decoded as U+FFFD), and never text that could still turn out to be the start of a stop
string (the last len(longest stop) - 1 characters wait until the next tokens or the end).
The matched stop string is not part of the output (OpenAI's behaviour).
"""

from __future__ import annotations

from typing import Sequence


class IncrementalDetokenizer:
    def __init__(self, tokenizer, *, stop: Sequence[str] = (),
                 stop_token_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.stop_token_ids = frozenset(stop_token_ids)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""          # all final text so far (after a stop string: cut before it)
        self.sent = 0           # characters of self.text already returned
        self.stopped = False    # a stop string matched: the request should end

    def _decode(self) -> str:
        ids = self.ids
        if ids and ids[-1] in self.stop_token_ids:  # the stop token is not text
            ids = ids[:-1]
        return self.tokenizer.decode(ids)

    def add(self, token_ids: Sequence[int], *, last: bool = False) -> str:
        """Take new token ids; return the text that became final. `last`: no more tokens
        come, so everything held back is released."""
        if self.stopped:
            return ""
        self.ids.extend(token_ids)
        full = self._decode()
        if self.stop:
            # Text before `sent - hold` was searched already and holds no whole stop string.
            start = max(0, self.sent - self.hold)
            found = [i for s in self.stop if (i := full.find(s, start)) >= 0]
            if found:
                full = full[:min(found)]
                self.stopped = last = True
        end = len(full)
        if not last:
            end -= self.hold
            while end > self.sent and full[end - 1] == "\ufffd":
                end -= 1
        end = max(end, self.sent)
        piece = full[self.sent:end]
        self.sent, self.text = end, full[:end]
        return piece
