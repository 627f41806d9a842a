"""The FastAPI app: OpenAI-compatible routes, `/v1/search`, `/v1/prm/score`, health, metrics, auth,
errors, and the traced searches' pages (`/v1/search/{id}/trace`, `/ui`, `/ui/{id}`; server/traces.py).

Owns the HTTP surface and its failure behaviour. Every error is an OpenAI-style body
(`{"error": {"message", "type", "param", "code"}}`): validation errors and bad values are
400, an unknown model 404, a missing or wrong API key 401, an engine step that failed
while serving the request 500 (a stream already under way ends with an error event). A client that disconnects
aborts its engine requests (streaming: Starlette cancels the response; non-streaming: a
watcher polls for the disconnect), so their pages return to the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any
from urllib.parse import urlencode

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from treeserve.runtime.runtime import StepFailed
from treeserve.server.completions import (
    Job,
    ModelNotFound,
    Served,
    chat_job,
    completion_job,
    full_response,
    stream_events,
)
from treeserve.server.core_client import CoreClient
from treeserve.server.metrics import RequestCounter
from treeserve.server.prm_api import PRM_ENGINE, ServedScores, check_request, score_request
from treeserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    PRMScoreRequest,
    SamplingFields,
    SearchRequest,
    error_body,
)
from treeserve.server.search_api import run_search, search_context, stream_search
from treeserve.server.traces import list_page, search_page
from treeserve.server.wire import CoreError

ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 401, 404)}
DISCONNECT_POLL_S = 0.05  # how often a stream or a waiting request checks that its client is still there
CLIENT_GONE = 499  # nginx's "client closed request": logged and counted, never seen by the client
UI_COOKIE = "treeserve_api_key"


class APIKeyMiddleware:
    """ASGI middleware: every route but /health needs `Authorization: Bearer KEY`. A browser,
    which cannot send that header, opens `/ui?token=KEY` once (as Jupyter does): the key goes
    into an HttpOnly cookie scoped to /ui and the address bar loses it; /ui pages then accept
    the cookie."""

    def __init__(self, app: Any, api_key: str):
        self.app = app
        self.key = api_key.encode()
        self.expected = b"Bearer " + self.key

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            ui = scope["path"] == "/ui" or scope["path"].startswith("/ui/")
            request = Request(scope) if ui else None  # its query and cookies: read on /ui pages only
            token = request.query_params.get("token", "").encode() if ui else b""
            if ui and token and hmac.compare_digest(token, self.key):
                await _remember_key(request, token.decode())(scope, receive, send)
                return
            cookie = request.cookies.get(UI_COOKIE, "").encode() if ui else b""
            if not (hmac.compare_digest(given, self.expected) or (cookie and hmac.compare_digest(cookie, self.key))):
                hint = ", or open /ui?token=KEY once in a browser" if ui else ""
                body = error_body(401, f"missing or invalid API key (send 'Authorization: Bearer KEY'{hint})")
                await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _remember_key(request: Request, key: str) -> Response:
    """303 to the same /ui address without its token, setting the key's cookie."""
    query = urlencode([(k, v) for k, v in request.query_params.multi_items() if k != "token"])
    response = RedirectResponse(request.url.path + (f"?{query}" if query else ""), status_code=303)
    response.set_cookie(UI_COOKIE, key, path="/ui", httponly=True, samesite="strict")
    return response


def build_app(served: Served, api_key: str | None = None) -> FastAPI:
    core = served.runtime if isinstance(served.runtime, CoreClient) else None
    scores = ServedScores(served.prm) if served.prm is not None else None  # in the core when there is one

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if core is not None:
            await core.start()  # in this event loop: its sockets and supervisor live here
        yield
        await served.runtime.close()

    app = FastAPI(title="treeserve", version="0.1.0", lifespan=lifespan)
    _add_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if core is not None and not core.up:
            return JSONResponse(error_body(503, "the engine core is not running (restarting)"), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", responses=ERRORS)
    async def metrics() -> Response:
        if core is not None:
            await core.stats()  # the engine state the collector reports
        content, media_type = served.metrics.render()
        return Response(content, media_type=media_type)

    @app.get("/v1/models", responses=ERRORS)
    async def models() -> dict:
        hosted = (
            (served.model_name, "generator", served.generator),
            (served.prm_name, "prm", PRM_ENGINE),
            (served.verifier_name, "verifier", "verifier"),
        )
        return {"object": "list", "data": [_card(served, *model) for model in hosted if model[0] is not None]}

    async def complete(request: Request, body: SamplingFields, job: Job, chat: bool) -> Response:
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse(request, stream_events(served, job, chat=chat, include_usage=include_usage))
        return await _unless_disconnected(request, full_response(served, job, chat=chat))

    @app.post("/v1/completions", responses=ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await complete(request, body, completion_job(served, body), chat=False)

    @app.post("/v1/chat/completions", responses=ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await complete(request, body, chat_job(served, body), chat=True)

    @app.post("/v1/search", responses=ERRORS)
    async def search(body: SearchRequest, request: Request) -> Response:
        if core is not None:  # the search program runs in the core, next to the engines
            return await _core_search(served, core, body, request)
        ctx, problem = search_context(served, body)
        if body.stream:
            return _sse(request, _keeping_traces(served, body, stream_search(served, body, ctx, problem)))
        return await _unless_disconnected(request, _keeping_trace(served, body, run_search(served, body, ctx, problem)))

    @app.post("/v1/prm/score", responses=ERRORS)
    async def prm_score(body: PRMScoreRequest, request: Request) -> Response:
        check_request(served, body)
        if core is not None:  # the PRM and the server's score cache live in the core
            return await _unless_disconnected(request, core.prm_score(await request.body()))
        return await _unless_disconnected(request, score_request(served, scores, body))

    @app.get("/v1/search/{search_id}/trace", responses=ERRORS)
    async def search_trace(search_id: str) -> Response:
        kept = served.traces.get(search_id)
        if kept is None:
            return JSONResponse(error_body(404, served.traces.missing(search_id)), status_code=404)
        return JSONResponse(
            {"id": search_id, "object": "search.trace", "problem": kept["problem"], "trace": kept["trace"]}
        )

    @app.get("/ui", response_class=HTMLResponse)
    async def ui() -> Response:
        return HTMLResponse(list_page(served.traces))

    @app.get("/ui/{search_id}", response_class=HTMLResponse)
    async def ui_search(search_id: str) -> Response:
        kept = served.traces.get(search_id)
        if kept is None:
            return JSONResponse(error_body(404, served.traces.missing(search_id)), status_code=404)
        return HTMLResponse(search_page(kept))

    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(RequestCounter, metrics=served.metrics)  # outermost: counts 401s too
    return app


def _card(served: Served, name: str, role: str, engine: str) -> dict:
    """One `/v1/models` entry: OpenAI's fields, the context length (as vLLM lists it) and the model's role."""
    max_model_len = served.runtime.engine(engine).max_model_len
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "treeserve",
        "max_model_len": max_model_len,
        "role": role,
    }


async def _core_search(served: Served, core: CoreClient, body: SearchRequest, request: Request) -> Response:
    """`/v1/search` forwarded to the core: a 400 before any work, else the result or its events."""
    start = time.perf_counter()
    messages = core.search(await request.body())
    try:
        await anext(messages)  # ["ok"], or the request's error raised
    except BaseException:
        await messages.aclose()
        raise

    async def events() -> AsyncIterator[str]:
        try:
            async with contextlib.aclosing(messages) as it:
                async for kind, *rest in it:
                    if kind == "event":
                        yield rest[0]
        except CoreError as e:  # the core died mid-search: the stream ends with the error (503)
            yield f"data: {json.dumps(error_body(e.status, str(e)))}\n\ndata: [DONE]\n\n"
            return
        served.metrics.search_seconds.labels(body.strategy).observe(time.perf_counter() - start)

    async def result() -> dict:
        async with contextlib.aclosing(messages) as it:
            async for kind, *rest in it:
                if kind == "done":
                    served.metrics.search_seconds.labels(body.strategy).observe(time.perf_counter() - start)
                    return rest[0]
        raise CoreError(500, "the engine core ended the search without a result")

    if body.stream:
        return _sse(request, _keeping_traces(served, body, events()))
    return await _unless_disconnected(request, _keeping_trace(served, body, result()))


def _keeping_trace(served: Served, body: SearchRequest, work: Awaitable[dict]) -> Awaitable[dict]:
    """`work` (a search's result), kept in the server's trace ring when the search is traced."""
    if not body.trace:
        return work

    async def keep() -> dict:
        result = await work
        served.traces.add(result)
        return result

    return keep()


def _keeping_traces(served: Served, body: SearchRequest, events: AsyncIterator[str]) -> AsyncIterator[str]:
    """A search's SSE events, its final result kept in the trace ring when the search is traced."""
    if not body.trace:
        return events

    async def keep() -> AsyncIterator[str]:
        async with contextlib.aclosing(events) as it:
            async for event in it:
                if event.startswith("data: {"):
                    result = json.loads(event[len("data: ") :])
                    if result.get("object") == "search":
                        served.traces.add(result)
                yield event

    return keep()


def _sse(request: Request, events: AsyncIterator[str]) -> StreamingResponse:
    """Server-Sent Events that stop (closing `events`, which aborts their engine requests) as
    soon as the client is gone. Checked between events, at most every DISCONNECT_POLL_S: with uvicorn's h11 protocol a
    write to a closed connection is silently dropped, and Starlette's own disconnect
    listener was measured not to stop a stream whose producer rarely waits."""

    async def until_disconnected() -> AsyncIterator[str]:
        checked = time.monotonic()
        async with contextlib.aclosing(events) as it:
            async for event in it:
                if time.monotonic() - checked > DISCONNECT_POLL_S:
                    if await request.is_disconnected():
                        return
                    checked = time.monotonic()
                yield event

    headers = {"Cache-Control": "no-cache"}
    return StreamingResponse(until_disconnected(), media_type="text/event-stream", headers=headers)


async def _unless_disconnected(request: Request, work: Awaitable[dict]) -> Response:
    """The JSON result of `work`, or (when the client goes away first) cancel it: its engine
    requests are aborted and their pages return to the pool."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return JSONResponse(task.result())
            if await request.is_disconnected():
                return Response(status_code=CLIENT_GONE)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors()[:5]:
            where = ".".join(str(part) for part in err.get("loc", ()) if part != "body")
            problems.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        return JSONResponse(error_body(400, "invalid request: " + "; ".join(problems)), status_code=400)

    @app.exception_handler(ModelNotFound)
    async def no_model(request: Request, exc: ModelNotFound) -> JSONResponse:
        return JSONResponse(error_body(404, str(exc)), status_code=404)

    @app.exception_handler(CoreError)
    async def core_error(request: Request, exc: CoreError) -> JSONResponse:
        return JSONResponse(error_body(exc.status, str(exc)), status_code=exc.status)

    @app.exception_handler(StepFailed)
    async def step_failed(request: Request, exc: StepFailed) -> JSONResponse:
        return JSONResponse(error_body(500, str(exc)), status_code=500)

    @app.exception_handler(ValueError)
    async def bad_value(request: Request, exc: ValueError) -> JSONResponse:
        return JSONResponse(error_body(400, str(exc)), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code, headers=exc.headers
        )
