"""The HTTP surface (Starlette): OpenAI's routes, the stats route, auth and body limits.

Nothing from a request reaches the file system: the model is the one loaded at start,
a request's ``model`` field is only compared with its name.
"""

from __future__ import annotations

import asyncio
import hmac
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ..runtime.generate import context_length, encode
from . import schemas
from .errors import APIError
from .responses import DONE, Shape, finish_reason, sse
from .telemetry import Telemetry
from .worker import Job, Worker


class Service:
    """What the routes share: the model's tokenizer and limits, the worker, the telemetry."""

    def __init__(self, model, tokenizer, settings) -> None:
        self.tokenizer, self.settings = tokenizer, settings
        self.context = context_length(model)
        self.created = int(time.time())  # the model was loaded just before: /v1/models says when
        self.telemetry = Telemetry(model)
        self.worker = Worker(model, tokenizer, self.telemetry.add, settings.max_queue)


def build_app(service: Service) -> Starlette:
    settings = service.settings

    def guarded(handler):
        async def route(request: Request):
            try:
                _check_key(request, settings.api_key)
                return await handler(request)
            except APIError as err:
                return JSONResponse(err.body(), status_code=err.status)
        return route

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": settings.model_name, "object": "model", "created": service.created, "owned_by": "expertcache"}]})

    async def stats(request: Request):
        return JSONResponse({"model": settings.model_name, **service.telemetry.snapshot()})

    async def health(request: Request):
        return JSONResponse({"status": "ok", "queued": service.worker.jobs.qsize()})

    async def chat(request: Request):
        return await _complete(service, request, chat=True)

    async def completions(request: Request):
        return await _complete(service, request, chat=False)

    routes = [Route("/health", health), Route("/v1/models", guarded(models)),
              Route("/v1/expertcache/stats", guarded(stats)),
              Route("/v1/chat/completions", guarded(chat), methods=["POST"]),
              Route("/v1/completions", guarded(completions), methods=["POST"])]
    return Starlette(routes=routes, exception_handlers={HTTPException: _http_error, Exception: _crash})


def _check_key(request: Request, key: str | None) -> None:
    if key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    # compare_digest: the time taken does not tell how much of the key was right
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "missing or wrong API key; send 'Authorization: Bearer <key>'",
                       code="invalid_api_key")


async def _complete(service: Service, request: Request, chat: bool):
    settings = service.settings
    req = schemas.parse(await read_body(request, settings.max_body_bytes), chat)
    if req.model != settings.model_name:
        raise APIError(404, f"model {req.model!r} is not served here; this server serves "
                            f"{settings.model_name!r} (GET /v1/models)", code="model_not_found", param="model")
    try:
        ids = encode(service.tokenizer, req.prompt, chat=chat)
    except ValueError as err:
        raise APIError(400, str(err), param="messages" if chat else "prompt") from None
    limit = schemas.budget(len(ids), req.max_tokens, context=service.context,
                           max_prompt=settings.max_prompt_tokens, max_tokens=settings.max_tokens,
                           prompt_param="messages" if chat else "prompt")
    job = Job(ids, limit, req.sampling, asyncio.get_running_loop())
    service.worker.submit(job)
    shape = Shape(chat, settings.model_name)
    if req.stream:
        return StreamingResponse(_stream(job, shape, req.include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    try:
        gen = await _result_unless_gone(request, job)
    finally:
        job.cancelled.set()  # no-op once done; stops the work if the client left
    return JSONResponse(shape.full(gen))


async def _result_unless_gone(request: Request, job: Job):
    """The job's result, or cancel it when the client disconnects first (no one would read it)."""
    async def gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass  # the body was read already: the next message is the disconnect

    waiter, watcher = asyncio.ensure_future(job.result()), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if waiter.done():
        return waiter.result()
    waiter.cancel()
    raise APIError(499, "the client closed the connection")  # nginx's code; nobody reads it


async def _stream(job: Job, shape: Shape, include_usage: bool):
    try:
        if shape.chat:
            yield shape.chunk(role=True)
        while True:
            kind, value = await job.events.get()
            if kind == "text":
                yield shape.chunk(value)
            elif kind == "error":
                yield sse(value.body())
                return
            else:
                yield shape.chunk(reason=finish_reason(value))
                if include_usage:
                    yield shape.usage_chunk(value)
                yield DONE
                return
    finally:
        job.cancelled.set()  # the client left (or the answer is complete): free the worker


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 past ``limit`` bytes (declared or actually sent)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the body has {declared} bytes; this server takes at most {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the body is over {limit} bytes, the most this server takes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _http_error(request: Request, exc: HTTPException):
    err = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
    return JSONResponse(err.body(), status_code=exc.status_code)


async def _crash(request: Request, exc: Exception):
    err = APIError(500, f"internal error: {type(exc).__name__}: {exc}")
    return JSONResponse(err.body(), status_code=500)
