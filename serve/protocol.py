"""OpenAI request bodies, their checks and the prompt's token ids (the server's side of the wire format).

Bodies use pydantic strict types (no bool as int, no "3" as 3, no NaN/Infinity) and forbid unknown fields. Known
OpenAI/vLLM fields this server does not implement are declared so that a request using them gets a 400 naming the
field, while their neutral values (`logit_bias: {}`, `n: 1`, `presence_penalty: 0`, ...) are accepted.
Chat prompts are rendered so that only the template's own markup can become special tokens (chat_prompt_ids).
"""
from __future__ import annotations

import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from dspark.request import SamplingParams

PROMPT_BYTES_PER_TOKEN = 32  # a generous bound: real tokenizers average 3-6 UTF-8 bytes per token


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


# field -> the values that mean "not used" (accepted); anything else is a 400 naming the field
UNSUPPORTED = {
    "n": (None, 1), "best_of": (None, 1), "echo": (None, False), "suffix": (None,),
    "logprobs": (None, False), "top_logprobs": (None, 0), "prompt_logprobs": (None,),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "repetition_penalty": (None, 1),
    "min_p": (None, 0), "min_tokens": (None, 0), "logit_bias": (None, {}),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}), "guided_json": (None,), "guided_regex": (None,),
    "guided_choice": (None,), "guided_grammar": (None,), "structured_outputs": (None,),
}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


class Body(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM's): 0 or -1 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, bool] | None = None
    ignore_eos: bool = False  # extension (vLLM's)
    user: str | None = None  # accepted, not used
    metadata: dict[str, str] | None = None  # accepted, not used
    # declared so that using them is a 400 that names them (see UNSUPPORTED)
    n: Any = None
    best_of: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    prompt_logprobs: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    min_p: Any = None
    min_tokens: Any = None
    logit_bias: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None

    def check_supported(self) -> None:
        for name, neutral in UNSUPPORTED.items():
            v = getattr(self, name, None)
            if not any(_same(v, x) for x in neutral):
                raise ApiError(400, f"{name}: not supported by this server (got {_short(v)})", name)


class CompletionBody(Body):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: Any = None
    suffix: Any = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]


class ChatBody(Body):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|function-.*|[A-Z]\w*)$")
_EXPECTED = {"prompt": "a string, a list of token ids (integers), or a one-element list of either",
             "stop": "a string or a list of strings",
             "content": 'a string or a list of {"type": "text", "text": ...} parts'}


def validation_message(err: dict) -> tuple[str, str | None]:
    """(message, top-level field) for pydantic's first error, with union member tags left out of the path."""
    loc = [x for x in err.get("loc", ()) if x != "body" and not (isinstance(x, str) and _UNION_TAG.match(x))]
    where = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".") or "body"
    named = [x for x in loc if isinstance(x, str)]
    got = _short(err.get("input"))
    if err.get("type") == "extra_forbidden":
        msg = f"{where}: unknown field (this server does not implement it)"
    elif err.get("type") == "missing":
        msg = f"{where}: required field missing"
    elif named and named[-1] in _EXPECTED:
        msg = f"{where}: expected {_EXPECTED[named[-1]]}, got {got}"
    else:
        msg = f"{where}: {err.get('msg', 'invalid value')} (got {got})"
    return msg, (named[0] if named else None)


def _same(v, x) -> bool:
    """v == x without bool/int/float confusion (True is not 1; 0.0 is 0)."""
    if x is None or isinstance(x, bool):
        return v is x
    if isinstance(x, (int, float)):
        return not isinstance(v, bool) and isinstance(v, (int, float)) and v == x
    return v == x


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def sampling_params(b: Body, max_tokens: int | None) -> tuple[SamplingParams, bool]:
    """The request's SamplingParams, checked and normalised; max_tokens None is set after tokenization (the bool
    says whether the client gave it)."""
    b.check_supported()
    t = 1.0 if b.temperature is None else b.temperature
    if not 0 <= t <= 2:
        raise ApiError(400, f"temperature: expected a number in [0, 2], got {t}", "temperature")
    top_k = 0 if b.top_k in (None, -1) else b.top_k
    if top_k < 0:
        raise ApiError(400, f"top_k: expected -1, 0 (off) or a positive integer, got {b.top_k}", "top_k")
    stop = [b.stop] if isinstance(b.stop, str) else list(b.stop or [])
    if any(s == "" for s in stop):
        raise ApiError(400, "stop: empty strings are not allowed", "stop")
    p = SamplingParams(max_tokens=1 if max_tokens is None else max_tokens, temperature=t,
                       top_p=1.0 if b.top_p is None else b.top_p, top_k=top_k, seed=b.seed, stop=stop,
                       ignore_eos=b.ignore_eos)
    try:
        p.validate()
    except ValueError as e:
        field = str(e).split(":", 1)[0]
        raise ApiError(400, str(e), field if field.isidentifier() else None) from None
    return p, max_tokens is not None


def check_prompt_size(prompt: str | list[int], max_bytes: int, max_tokens: int, vocab: int) -> int:
    """Reject what cannot fit before any tokenizing: text over max_bytes UTF-8 bytes, ids over max_tokens or out of
    the vocabulary. -> the text's UTF-8 bytes (0 for ids)."""
    if isinstance(prompt, str):
        n = len(prompt) if len(prompt) > max_bytes else len(prompt.encode("utf-8"))
        if n > max_bytes:
            raise ApiError(400, f"prompt: {n} bytes exceed this server's limit of {max_bytes} bytes "
                           "(--max-prompt-bytes)", "prompt")
        return n
    if len(prompt) > max_tokens:
        raise ApiError(400, f"prompt: {len(prompt)} tokens exceed the context length {max_tokens}", "prompt")
    if any(not 0 <= t < vocab for t in prompt):
        raise ApiError(400, f"prompt: token ids must be integers in [0, {vocab})", "prompt")
    return 0


def message_texts(messages: list[ChatMessage]) -> list[dict]:
    return [{"role": m.role, "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)}
            for m in messages]


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the chat prompt in which message content is plain text: the template is rendered with a unique
    marker in place of each content, the rendered string is cut at the markers, the template's pieces are tokenized
    with their special tokens and each content with special-token strings kept as text (a user's
    `<|im_end|><|im_start|>system` stays text)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "messages: this model has no chat template; use /v1/completions", "messages")
    tag = uuid.uuid4().hex
    marks = [f"\ue000{tag}:{i}\ue001" for i in range(len(messages))]
    try:
        rendered = tokenizer.apply_chat_template([{**m, "content": mk} for m, mk in zip(messages, marks)],
                                                 add_generation_prompt=True, tokenize=False)
    except Exception as e:  # noqa: BLE001 - a template error is the caller's message structure
        raise ApiError(400, f"messages: the chat template rejected these messages: {e}", "messages") from None
    ids: list[int] = []
    rest = rendered
    for i, (m, mk) in enumerate(zip(messages, marks)):
        if rendered.count(mk) != 1 or mk not in rest:
            raise ApiError(400, f"messages[{i}]: this model's chat template does not place a {m['role']} message's "
                           "content verbatim; send a rendered prompt to /v1/completions", "messages")
        head, rest = rest.split(mk, 1)
        ids += tokenizer.encode(head, add_special_tokens=False)
        ids += tokenizer.encode(m["content"], add_special_tokens=False, split_special_tokens=True)
    return ids + tokenizer.encode(rest, add_special_tokens=False)
