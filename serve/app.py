"""OpenAI-compatible HTTP API over the engine thread (FastAPI).

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both with SSE streaming that ends with
`data: [DONE]`), GET /health, GET /metrics (Prometheus text, vLLM's spec-decode counter names plus dspark: gauges).
Errors are OpenAI-style JSON `{"error": {"message", "type", "param", "code"}}`: 4xx messages name the field and what
was expected; 5xx messages are generic with a request id, the details go to the server log.
With an API key, every /v1 route needs `Authorization: Bearer <key>` (as vLLM's --api-key); /health and /metrics stay
open. Prompts are size-checked before tokenizing and tokenized in a thread pool, never on the engine thread.
A client that disconnects (streaming or not) has its request aborted, which frees its cache at once.
"""
from __future__ import annotations

import asyncio
import gc
import hmac
import json
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark.request import SamplingParams
from serve.engine_client import EngineClient
from serve.metrics import metrics_text
from serve.protocol import (
    PROMPT_BYTES_PER_TOKEN,
    ApiError,
    Body,
    ChatBody,
    CompletionBody,
    chat_prompt_ids,
    check_prompt_size,
    message_texts,
    sampling_params,
    validation_message,
)
from serve.runner import EngineDead, EngineRunner, Event

log = logging.getLogger("serve.app")
ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 503: "service_unavailable"}
TOKENIZER_NICE = 10  # tokenizer threads run this much nicer than the engine thread
JSON_BYTES_PER_PROMPT_BYTE = 6  # the worst JSON escaping: "\u0001" for one byte


@dataclass
class ServerConfig:
    served_model_name: str
    max_concurrent: int = 64
    default_max_tokens: int = 16  # /v1/completions without max_tokens (OpenAI's default)
    disconnect_poll_s: float = 0.5  # non-streaming requests check for a gone client this often
    api_key: str | None = None  # None: no authentication
    max_prompt_bytes: int | None = None  # None: max_model_len * PROMPT_BYTES_PER_TOKEN
    tokenizer_threads: int = 2
    inline_tokenize_bytes: int = 4096  # prompts up to this size are tokenized on the event loop (the hop to a
    # tokenizer thread and back costs more than tokenizing them); longer ones in the tokenizer threads


def _lower_priority() -> None:
    """Tokenizer threads yield the CPU to the engine thread and the event loop (Linux: nice is per thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), TOKENIZER_NICE)
    except (AttributeError, OSError):  # not Linux, or not permitted: run at normal priority
        pass


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code if code is not None else status}}
    return JSONResponse(body, status_code=status)


def internal_error(rid: str) -> ApiError:
    return ApiError(500, f"internal server error (request id {rid}); the details are in the server log")


class _Gate:
    """ASGI middleware: the API key on /v1 routes, and a body-size limit read from Content-Length before any JSON
    parsing (a prompt of max_prompt_bytes, fully escaped, plus room for the other fields)."""

    def __init__(self, app, cfg: ServerConfig):
        self.app, self.cfg = app, cfg

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            resp = self.check(scope)
            if resp is not None:
                return await resp(scope, receive, send)
        await self.app(scope, receive, send)

    def check(self, scope) -> JSONResponse | None:
        headers = dict(scope.get("headers") or ())
        if self.cfg.api_key is not None and scope["path"].startswith("/v1"):
            if not hmac.compare_digest(headers.get(b"authorization", b""), f"Bearer {self.cfg.api_key}".encode()):
                return error_response(401, "invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                                      code="invalid_api_key")
        limit = JSON_BYTES_PER_PROMPT_BYTE * self.cfg.max_prompt_bytes + (1 << 20)
        size = headers.get(b"content-length", b"")
        if size.isdigit() and int(size) > limit:
            return error_response(413, f"body: {int(size)} bytes exceed this server's limit of {limit} bytes (set by "
                                  f"--max-prompt-bytes {self.cfg.max_prompt_bytes})", "body")
        return None


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


def create_app(runner: EngineRunner | EngineClient, cfg: ServerConfig) -> FastAPI:
    """The routes over an engine thread in this process (EngineRunner) or an engine process (EngineClient)."""
    info, tokenizer = runner.info, runner.tokenizer
    if cfg.max_prompt_bytes is None:
        cfg.max_prompt_bytes = info.max_model_len * PROMPT_BYTES_PER_TOKEN
    app = FastAPI(title="DSpark OpenAI-compatible server")
    app.add_middleware(_Gate, cfg=cfg)
    app.state.runner, app.state.cfg = runner, cfg
    app.state.tokenize_pool = pool = ThreadPoolExecutor(cfg.tokenizer_threads, thread_name_prefix="dspark-tokenize",
                                                        initializer=_lower_priority)
    active = {"n": 0}
    vocab = info.vocab_size

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return error_response(e.status, e.message, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}")
        return error_response(400, *validation_message(first))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def _internal(http: Request, e: Exception):
        rid = f"err-{uuid.uuid4().hex}"
        log.error("request %s (%s %s) failed", rid, http.method, http.url.path, exc_info=e)
        err = internal_error(rid)
        return error_response(err.status, err.message)

    def check_model(name: str | None) -> None:
        if name is not None and name != cfg.served_model_name:
            raise ApiError(404, f"The model `{name}` does not exist. This server serves `{cfg.served_model_name}`.",
                           "model", "model_not_found")

    @app.get("/health")
    async def health():
        if not runner.alive:
            return error_response(503, "the engine thread is not running; see the server log")
        return JSONResponse({})

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": cfg.served_model_name, "object": "model", "created": 0,
                                            "owned_by": "dspark", "root": cfg.served_model_name, "parent": None,
                                            "max_model_len": info.max_model_len}]}

    if runner.profiler is not None:  # vLLM's profiling routes, only with a profile dir (as vLLM registers them)
        @app.post("/start_profile")
        async def start_profile():
            return await profile("start")

        @app.post("/stop_profile")
        async def stop_profile():
            return await profile("stop")

        async def profile(action: str):
            try:
                return JSONResponse({"files": await runner.profile(action)})
            except EngineDead:
                return error_response(503, "the engine thread is not running; see the server log")
            except RuntimeError as e:
                return error_response(409, str(e))

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(metrics_text(await runner.fresh_snapshot(), cfg.served_model_name),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    def fit(ids: list[int], params: SamplingParams, explicit: bool, default_max_tokens: int | None) -> None:
        """The token-count check, before the request reaches the engine thread; sets max_tokens when not given."""
        room = info.max_model_len - len(ids) - info.k - 1
        if explicit and params.max_tokens > room:
            raise ApiError(400, f"prompt: {len(ids)} tokens + max_tokens {params.max_tokens} exceed the context "
                           f"length {info.max_model_len}", "prompt")
        if room < 1:
            raise ApiError(400, f"prompt: {len(ids)} tokens leave no room to generate within the context length "
                           f"{info.max_model_len}", "prompt")
        if not explicit:
            params.max_tokens = min(room, default_max_tokens or room)

    async def generate(http: Request, chat: bool, tokenize, size: int, params: SamplingParams, explicit: bool,
                       body: Body, default_max_tokens: int | None):
        """tokenize: a function returning the prompt's ids, of a prompt of `size` UTF-8 bytes (0: token ids), run
        here when size <= cfg.inline_tokenize_bytes, else in the tokenizer pool."""
        if not runner.alive:
            raise ApiError(503, "the engine thread is not running; see the server log")
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
            if size <= cfg.inline_tokenize_bytes:
                ids = tokenize()
            else:
                ids = await asyncio.get_running_loop().run_in_executor(pool, tokenize)
            fit(ids, params, explicit, default_max_tokens)
            req, events = await runner.submit(ids, params, rid)
        except ApiError:
            state["done"] = True
            release()
            raise
        except ValueError as e:  # the engine rejected the request
            state["done"] = True
            release()
            msg = str(e)
            raise ApiError(400, msg, msg.split(":", 1)[0] if msg.split(":", 1)[0].isidentifier() else None) from None
        except EngineDead:
            state["done"] = True
            release()
            raise ApiError(503, "the engine thread is not running; see the server log") from None
        except Exception:
            state["done"] = True
            release()
            log.exception("request %s failed before it started", rid)
            raise internal_error(rid) from None
        except BaseException:
            release()
            raise
        created = int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": cfg.served_model_name}

        def usage(ev: Event) -> dict:
            return {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
                    "total_tokens": ev.prompt_tokens + ev.completion_tokens}

        def failed(ev: Event) -> ApiError:
            log.error("request %s failed: %s", rid, ev.error)
            return internal_error(rid)

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
                        err = failed(ev)
                        yield _sse({"error": {"message": err.message, "type": "server_error", "param": None,
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
                    raise failed(ev)
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
        params, explicit = sampling_params(body, body.max_tokens)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ApiError(400, f"prompt: one prompt per request is supported, got {len(prompt)}", "prompt")
            prompt = prompt[0]
        if len(prompt) == 0:
            raise ApiError(400, "prompt: empty", "prompt")
        size = check_prompt_size(prompt, cfg.max_prompt_bytes, info.max_model_len, vocab)  # UTF-8 bytes, 0 for ids
        if isinstance(prompt, str):
            tok = tokenizer
            if tok is None:
                raise ApiError(400, "prompt: this model has no tokenizer; send token ids", "prompt")
            tokenize = lambda: tok.encode(prompt, add_special_tokens=False)  # noqa: E731
        else:
            tokenize = lambda: list(prompt)  # noqa: E731
        return await generate(http, False, tokenize, size, params, explicit, body, cfg.default_max_tokens)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, http: Request):
        check_model(body.model)
        if not body.messages:
            raise ApiError(400, "messages: expected at least one message", "messages")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params, explicit = sampling_params(body, max_tokens)
        msgs = message_texts(body.messages)
        size = sum(len(m["content"].encode("utf-8")) for m in msgs)
        if size > cfg.max_prompt_bytes:
            raise ApiError(400, f"messages: {size} bytes of content exceed this server's limit of "
                           f"{cfg.max_prompt_bytes} bytes (--max-prompt-bytes)", "messages")
        tok = tokenizer
        end_of_turn = tok.convert_tokens_to_ids("<|im_end|>") if tok is not None else None
        if isinstance(end_of_turn, int) and end_of_turn != tok.unk_token_id:
            params.stop_token_ids.append(end_of_turn)  # a chat turn ends at <|im_end|>
        return await generate(http, True, lambda: chat_prompt_ids(tok, msgs), size, params, explicit, body, None)

    return app


_frozen_by = 0  # servers of this process up with the heap frozen


def freeze_heap(app: FastAPI) -> None:
    """Keep what lives once a server is up (models, engine, graphs, the web stack) out of the garbage collector's
    full passes until its shutdown(): a pass over that heap takes tenths of a second, and the engine thread and the
    event loop, every stream with them, wait for it (vLLM's freeze_gc_heap)."""
    global _frozen_by
    gc.collect()
    gc.freeze()
    app.state.heap_frozen = True
    _frozen_by += 1


def shutdown(app: FastAPI) -> None:
    """Stop the engine thread and the tokenizer pool; with the last server of the process stopped, the frozen heap
    is collectable again. Once per app; a second call does nothing more."""
    global _frozen_by
    app.state.runner.stop()
    app.state.tokenize_pool.shutdown(wait=False, cancel_futures=True)
    if getattr(app.state, "heap_frozen", False):
        app.state.heap_frozen = False
        _frozen_by -= 1
        if not _frozen_by:
            gc.unfreeze()
