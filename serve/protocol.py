"""OpenAI protocol models (the subset served) and the OpenAI error body.

Requests are parsed strictly: a wrong type is a 400 naming the field, never a silent
coercion ("5" is not a max_tokens). Unknown fields are ignored, as OpenAI-compatible
servers do; supported names whose values this server cannot honour (n > 1, logprobs,
penalties) are refused with a sentence saying so.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

Float = Annotated[float, Field(strict=True)]   # ints are fine, strings and bools are not
ROLES = ("system", "user", "assistant")
MAX_STOP_STRINGS = 8


class APIError(Exception):
    """An error the server answers with an OpenAI error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (status, message, type,
                                                                       param, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class SamplingFields(BaseModel):
    """What completions and chat completions share."""
    model_config = ConfigDict(extra="ignore")

    model: Optional[StrictStr] = None
    max_tokens: Optional[StrictInt] = None
    temperature: Float = 1.0
    top_p: Float = 1.0
    top_k: StrictInt = 0                 # extension; 0 or -1 disables
    seed: Optional[StrictInt] = None
    stop: Union[StrictStr, list[StrictStr], None] = None
    stop_token_ids: Optional[list[StrictInt]] = None   # extension
    ignore_eos: StrictBool = False                      # extension
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    n: StrictInt = 1
    logprobs: Any = None
    presence_penalty: Float = 0.0
    frequency_penalty: Float = 0.0
    user: Optional[StrictStr] = None

    def stop_strings(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(stop)

    def check_supported(self) -> None:
        if self.n != 1:
            raise APIError(400, f"n must be 1 (one choice per request), got {self.n}",
                           param="n")
        if self.logprobs not in (None, False, 0):
            raise APIError(400, "logprobs are not supported by this server", param="logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise APIError(400, f"{name} is not supported by this server (only 0)",
                               param=name)
        if len(self.stop_strings()) > MAX_STOP_STRINGS:
            raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options needs stream: true", param="stream_options")


class CompletionRequest(SamplingFields):
    prompt: Union[StrictStr, list[StrictStr], list[StrictInt]]
    echo: StrictBool = False

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise APIError(400, "echo is not supported by this server", param="echo")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: StrictStr
    content: Union[StrictStr, list[TextPart], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[StrictInt] = None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or messages rendered with the chat template."""
    model_config = ConfigDict(extra="ignore")
    model: Optional[StrictStr] = None
    prompt: Optional[StrictStr] = None
    messages: Optional[list[ChatMessage]] = None

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")


def request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, accept_lengths: list[int]) -> dict:
    """OpenAI usage plus the speculative decoder's record: target passes after prefill and
    the mean tokens per pass (0.0 with no pass; 1.0 for AR)."""
    passes = len(accept_lengths)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "target_passes": passes,
            "mean_accept_length": round(sum(accept_lengths) / passes, 4) if passes else 0.0}
