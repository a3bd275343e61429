"""A request's sampling parameters and its state while the engine runs it (nano-vllm's sequence.py)."""
from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from dspark.fields import check_int
from dspark.spec.sampling import request_seed

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS): 1/T would overflow the logits
MIN_TOP_P = 1e-6  # below 1/vocab for any vocab under a million: only the most likely token can survive, i.e. greedy
SEED_RANGE = (-2**63, 2**64)  # seeds fold into int64 (dspark.spec.sampling)

@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)  # e.g. the chat end-of-turn token
    ignore_eos: bool = False

    def validate(self) -> None:
        """Check every field (ValueError naming it), then normalise like vLLM: a temperature below SAMPLING_EPS or a
        top_p below MIN_TOP_P means greedy (temperature 0, top_p 1, top_k 0), so no 1/T overflow or empty nucleus
        ever reaches the batched sampling step."""
        check_int("max_tokens", self.max_tokens, 1)
        check_int("top_k", self.top_k, 0)
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name}: expected a finite number, got {v!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature: expected >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected in (0, 1], got {self.top_p}")
        if self.seed is not None:
            check_int("seed", self.seed, *SEED_RANGE)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop: expected non-empty strings")
        for t in self.stop_token_ids:
            check_int("stop_token_ids", t, 0)
        if self.temperature < SAMPLING_EPS or self.top_p < MIN_TOP_P:
            self.temperature, self.top_p, self.top_k = 0.0, 1.0, 0


class Status(Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "length" | "stop" | "abort" | None while running
    num_steps: int  # target decode/verify forwards after the prefill
    accepted_per_step: list[int]  # accepted drafts per verify step (0 .. k)
    num_drafts_per_step: list[int]  # drafts verified per step (k, or fewer with adaptive verification)


_ids = itertools.count()


def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """ids -> tokenizer.decode(ids, skip_special_tokens=True). For a fast tokenizer that would not clean up spaces,
    the Rust backend's decode itself: what transformers calls, without its Python wrapping (most of a call's time,
    paid per request per step by streaming)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalText:
    """A growing token list's text (vLLM's detokenizer): each call decodes only the tokens since the last character
    boundary, with the window before them as context, so a stream costs O(new tokens) per step rather than the whole
    output. Special tokens skipped; a trailing partial UTF-8 character shows as '\ufffd'."""

    def __init__(self, tokenizer):
        self._decode = text_decoder(tokenizer)
        # ids[:_read] decode to _stable and end on a character boundary; ids[_prefix:_read] is the window the next
        # tokens are decoded after
        self._stable, self._prefix, self._read = "", 0, 0
        self._text, self._at = "", 0

    def text(self, ids: list[int]) -> str:
        """The text of ids, which extend the ids of the previous call."""
        if self._at != len(ids):
            before = self._decode(ids[self._prefix:self._read])
            tail = self._decode(ids[self._prefix:])[len(before):]
            if tail and not tail.endswith("\ufffd"):  # a boundary: the next window starts at the old read point
                self._stable += tail
                self._prefix, self._read, tail = self._read, len(ids), ""
            self._text, self._at = self._stable + tail, len(ids)
        return self._text


class Request:
    def __init__(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                 prompt_text: str | None = None, tokenizer=None, seed: int | None = None):
        params.validate()
        if not prompt_ids:
            raise ValueError("prompt: empty after tokenization")
        self.id = request_id if request_id is not None else f"req-{next(_ids)}"
        self.prompt_ids = list(prompt_ids)
        self.prompt_text = prompt_text
        self.params = params
        self.output_ids: list[int] = []
        self.status = Status.WAITING
        self.num_computed = 0  # tokens in the target cache
        self.num_context = 0  # of those, the ones whose drafter context rows are written (plain steps stash the rest)
        # whether its decode steps keep the drafter's context (stashed by plain steps): without, it never drafts and
        # its plain steps are the AR engine's (the engine decides at admission: Engine._keeps_context)
        self.context = True
        self.num_steps = 0
        self.accepted_per_step: list[int] = []
        self.num_drafts_per_step: list[int] = []
        self.finish_reason: str | None = None
        self.arrival = time.perf_counter()  # added to the engine; admitted (first scheduled) at `admitted`
        self.admitted: float | None = None
        self.tokenizer = tokenizer  # decodes `text` on demand
        self._detok = IncrementalText(tokenizer) if tokenizer is not None else None
        self._pinned: tuple[str, int] | None = None  # (text, at len(output_ids)): a stop string cut the text
        # every random number the request draws is a function of this seed and its position (dspark.runner)
        self.seed = request_seed(seed if seed is not None else params.seed)

    @property
    def text(self) -> str:
        """The decoded output (special tokens skipped; a trailing partial UTF-8 character shows as '\ufffd'),
        decoded incrementally (IncrementalText)."""
        if self._pinned is not None and self._pinned[1] == len(self.output_ids):
            return self._pinned[0]
        return self._detok.text(self.output_ids) if self._detok is not None else ""

    @text.setter
    def text(self, value: str) -> None:  # pinned until more tokens arrive (a stop string cut it)
        self._pinned = (value, len(self.output_ids))

    @property
    def last_token(self) -> int:
        return self.output_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def output(self) -> RequestOutput:
        return RequestOutput(self.id, self.prompt_ids, list(self.output_ids), self.text, self.finish_reason,
                             self.num_steps, list(self.accepted_per_step), list(self.num_drafts_per_step))
