"""OpenAI-compatible HTTP API over the engine thread (FastAPI).

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both with SSE streaming that ends with
`data: [DONE]`), GET /health, GET /metrics (Prometheus text, vLLM's spec-decode counter names plus dspark: gauges).
Errors are OpenAI-style JSON `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status.
A client that disconnects (streaming or not) has its request aborted, which frees its cache at once.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark.request import SamplingParams
from serve.runner import EngineRunner, Event

ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


@dataclass
class ServerConfig:
    served_model_name: str
    max_concurrent: int = 64
    root: str = ""  # the target dir, shown in /v1/models
    default_max_tokens: int = 16  # /v1/completions without max_tokens (OpenAI's default)
    disconnect_poll_s: float = 0.5  # non-streaming requests check for a gone client this often


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code if code is not None else status}}
    return JSONResponse(body, status_code=status)


# ---------------------------------------------------------------------------- request bodies
class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown OpenAI fields (user, logit_bias=None, ...) are ignored
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM's): 0 or -1 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    ignore_eos: bool = False  # extension (vLLM's)


class CompletionBody(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatBody(_Body):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None


def sampling_params(b: _Body, max_tokens: int | None) -> SamplingParams:
    if b.n != 1:
        raise ApiError(400, f"n: only n=1 is supported, got {b.n}", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(b, name):
            raise ApiError(400, f"{name}: not supported (must be 0 or absent)", name)
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"max_tokens: expected an integer >= 1, got {max_tokens}", "max_tokens")
    t = 1.0 if b.temperature is None else b.temperature
    if not 0 <= t <= 2:
        raise ApiError(400, f"temperature: expected a number in [0, 2], got {t}", "temperature")
    top_p = 1.0 if b.top_p is None else b.top_p
    if not 0 < top_p <= 1:
        raise ApiError(400, f"top_p: expected a number in (0, 1], got {top_p}", "top_p")
    top_k = 0 if b.top_k in (None, -1) else b.top_k
    if top_k < 0:
        raise ApiError(400, f"top_k: expected -1, 0 (off) or a positive integer, got {b.top_k}", "top_k")
    stop = [b.stop] if isinstance(b.stop, str) else list(b.stop or [])
    if any(s == "" for s in stop):
        raise ApiError(400, "stop: empty strings are not allowed", "stop")
    return SamplingParams(max_tokens=max_tokens, temperature=t, top_p=top_p, top_k=top_k, seed=b.seed, stop=stop,
                          ignore_eos=b.ignore_eos)


def _chat_prompt(tokenizer, messages: list[ChatMessage]) -> str:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "messages: this model has no chat template; use /v1/completions", "messages")
    msgs = []
    for m in messages:
        c = m.content
        if isinstance(c, list):  # content parts: only text is supported
            if any(p.get("type") != "text" for p in c):
                raise ApiError(400, "messages: only text content parts are supported", "messages")
            c = "".join(p.get("text", "") for p in c)
        msgs.append({"role": m.role, "content": c or ""})
    try:
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # noqa: BLE001 - a template error is the caller's message structure
        raise ApiError(400, f"messages: chat template failed: {e}", "messages") from None


# ---------------------------------------------------------------------------- metrics
def metrics_text(runner: EngineRunner, model: str) -> str:
    s = runner.snapshot
    c = s.counters
    lab = f'engine="0",model_name="{model}"'
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{{{labels}}} {float(v)}" for labels, v in samples)

    metric("vllm:spec_decode_num_drafts_total", "counter", "Number of spec decoding drafts.",
           [(lab, c["num_drafts"])])
    metric("vllm:spec_decode_num_draft_tokens_total", "counter", "Number of draft tokens.",
           [(lab, c["num_draft_tokens"])])
    metric("vllm:spec_decode_num_accepted_tokens_total", "counter", "Number of accepted tokens.",
           [(lab, c["num_accepted_tokens"])])
    metric("vllm:spec_decode_num_accepted_tokens_per_pos_total", "counter", "Accepted tokens per draft position.",
           [(f'{lab},position="{i}"', v) for i, v in enumerate(c["num_accepted_tokens_per_pos"])])
    metric("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", [(lab, c["prompt_tokens"])])
    metric("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
           [(lab, c["generation_tokens"])])
    for prefix in ("vllm", "dspark"):
        metric(f"{prefix}:num_requests_running", "gauge", "Requests in the running batch.", [(lab, s.running)])
        metric(f"{prefix}:num_requests_waiting", "gauge", "Requests waiting for admission.", [(lab, s.waiting)])
    metric("dspark:cache_blocks_used", "gauge", "KV cache blocks in use.", [(lab, s.blocks_used)])
    metric("dspark:cache_blocks_free", "gauge", "KV cache blocks free.", [(lab, s.blocks_free)])
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- the app
class _AbortingStream(StreamingResponse):
    """Runs `on_close` however the response ends: finished, client gone (task cancelled) or never started."""

    def __init__(self, content, on_close, **kw):
        super().__init__(content, media_type="text/event-stream", **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def create_app(runner: EngineRunner, cfg: ServerConfig) -> FastAPI:
    app = FastAPI(title="DSpark OpenAI-compatible server")
    app.state.runner, app.state.cfg = runner, cfg
    active = {"n": 0}
    engine = runner.engine

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return error_response(e.status, e.message, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [x for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return error_response(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}")
        param = str(loc[0]) if loc else None  # the top-level field (a union's member names are noise)
        where = ".".join(str(x) for x in loc) or "body"
        return error_response(400, f"{where}: {first.get('msg', 'invalid request')}", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def _internal(_, e: Exception):
        return error_response(500, f"internal error: {type(e).__name__}: {e}")

    def check_model(name: str | None) -> None:
        if name is not None and name != cfg.served_model_name:
            raise ApiError(404, f"The model `{name}` does not exist. This server serves `{cfg.served_model_name}`.",
                           "model", "model_not_found")

    @app.get("/health")
    async def health():
        if not runner.alive:
            return error_response(503, runner.error or "engine thread is not running")
        return JSONResponse({})

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": cfg.served_model_name, "object": "model", "created": 0,
                                            "owned_by": "dspark", "root": cfg.root, "parent": None,
                                            "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(metrics_text(runner, cfg.served_model_name),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    async def generate(http: Request, chat: bool, prompt, params: SamplingParams, body: _Body,
                       default_max_tokens: int | None):
        if not runner.alive:
            raise ApiError(503, runner.error or "engine thread is not running")
        if active["n"] >= cfg.max_concurrent:
            raise ApiError(429, f"too many concurrent requests: the server admits at most {cfg.max_concurrent} "
                           "(--max-concurrent); retry later", code="too_many_requests")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        active["n"] += 1
        state = {"done": False, "released": False}

        def release() -> None:
            if not state["done"]:
                runner.abort(rid)
                state["done"] = True
            if not state["released"]:
                state["released"] = True
                active["n"] -= 1

        try:
            req, events = await runner.submit(prompt, params, rid, default_max_tokens)
        except ValueError as e:
            state["done"] = True
            release()
            raise ApiError(400, str(e), "prompt" if str(e).startswith("prompt") else None) from None
        except BaseException:
            release()
            raise
        created = int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": cfg.served_model_name}

        def usage(ev: Event) -> dict:
            return {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
                    "total_tokens": ev.prompt_tokens + ev.completion_tokens}

        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))

            def choice(text: str | None, finish: str | None, first: bool = False) -> dict:
                if chat:
                    delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
                    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

            async def stream():
                if chat:
                    yield _sse({**head, "choices": [choice(None, None, first=True)]})
                while True:
                    ev: Event = await events.get()
                    if ev.error is not None:
                        state["done"] = True
                        yield _sse({"error": {"message": ev.error, "type": "server_error", "param": None,
                                              "code": 500}})
                        break
                    if ev.text or ev.finish_reason:
                        if ev.finish_reason is not None:
                            state["done"] = True
                        if ev.text:
                            yield _sse({**head, "choices": [choice(ev.text, None)]})
                        if ev.finish_reason is not None:
                            yield _sse({**head, "choices": [choice(None, ev.finish_reason)]})
                            if include_usage:
                                yield _sse({**head, "choices": [], "usage": usage(ev)})
                            break
                yield "data: [DONE]\n\n"

            return _AbortingStream(stream(), release)

        try:
            text, loop = [], asyncio.get_running_loop()
            checked = loop.time()
            while True:
                try:
                    ev = await asyncio.wait_for(events.get(), cfg.disconnect_poll_s)
                except TimeoutError:
                    ev = None
                if loop.time() - checked >= cfg.disconnect_poll_s:  # events may never pause: check by the clock
                    checked = loop.time()
                    if await http.is_disconnected():
                        return error_response(499, "client disconnected")  # never seen by the gone client
                if ev is None:
                    continue
                text.append(ev.text)
                if ev.error is not None:
                    state["done"] = True
                    raise ApiError(500, ev.error)
                if ev.finish_reason is not None:
                    state["done"] = True
                    break
        finally:
            release()
        out = "".join(text)
        if chat:
            ch = {"index": 0, "message": {"role": "assistant", "content": out}, "logprobs": None,
                  "finish_reason": ev.finish_reason}
            return {**head, "object": "chat.completion", "choices": [ch], "usage": usage(ev)}
        return {**head, "choices": [{"index": 0, "text": out, "logprobs": None, "finish_reason": ev.finish_reason}],
                "usage": usage(ev)}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: Request):
        check_model(body.model)
        if body.echo:
            raise ApiError(400, "echo: not supported", "echo")
        for name in ("logprobs", "suffix"):
            if getattr(body, name) is not None:
                raise ApiError(400, f"{name}: not supported", name)
        if body.best_of not in (None, 1):
            raise ApiError(400, "best_of: only 1 is supported", "best_of")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ApiError(400, f"prompt: one prompt per request is supported, got {len(prompt)}", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, (str, list)) and len(prompt) == 0:
            raise ApiError(400, "prompt: empty", "prompt")
        params = sampling_params(body, body.max_tokens)
        default = None
        if body.max_tokens is None:
            params.max_tokens, default = None, cfg.default_max_tokens
        return await generate(http, False, prompt, params, body, default)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, http: Request):
        check_model(body.model)
        if body.logprobs:
            raise ApiError(400, "logprobs: not supported", "logprobs")
        if not body.messages:
            raise ApiError(400, "messages: expected at least one message", "messages")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = sampling_params(body, max_tokens)
        prompt = _chat_prompt(engine.tokenizer, body.messages)
        end_of_turn = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(end_of_turn, int) and end_of_turn != engine.tokenizer.unk_token_id:
            params.stop_token_ids.append(end_of_turn)  # a chat turn ends at <|im_end|>
        return await generate(http, True, prompt, params, body, None)  # no max_tokens: the rest of the context

    return app
