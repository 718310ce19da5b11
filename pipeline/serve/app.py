"""The HTTP service of ``newsvec serve``: ``create_app(config, engine)`` makes it (a Starlette app,
constructible in-process for tests and benchmarks), its routes read and answer JSON by hand
(``orjson``; no model validation on the hot path).

Routes:
- ``POST /v1/embeddings``: OpenAI's embeddings API. Inputs are embedded as queries (``Service.
  query_prompts``: ``model.query_prefix`` before the normalized text, as ``newsvec search``
  embeds a query), or with ``input_type: "document"`` as the pipeline embeds an article
  (``Service.document_prompts``: its PrepareText step, ``pipeline.graph.prepare_text``);
- ``POST /v1/search``: the nearest stories of the corpus (``pipeline.serve.corpus``);
- ``GET /info``: what a client checks itself against (model, prefixes, signature, output);
- ``GET /v1/models``: the one model, as OpenAI's clients list it;
- ``GET /healthz`` (alive), ``GET /readyz`` (ready: not draining, the store reachable),
  ``GET /metrics`` (``pipeline.serve.metrics``);
- ``GET /status``, ``GET /status.json``: the operator's status of the output
  (``pipeline.serve.pages``);
- ``GET /`` and its files: the search page (``pipeline.serve.search_page``).
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from typing import Any, Awaitable, Callable, Optional, TypeVar

import numpy as np
import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from pipeline.config import Config, signature_of
from pipeline.search import Filters
from pipeline.serve import auth, search_page
from pipeline.serve.batcher import Batcher, Draining, InputFailed, QueueFull
from pipeline.serve.corpus import Corpus, corpus_for, output_record
from pipeline.serve.limits import ApiError, bad, embeddings_request, read_json, search_request
from pipeline.serve.metrics import ServeMetrics
from pipeline.serve.pages import status_routes
from transforms.engines.base import EngineFailedError, ModelHandle, truncate_vector
from transforms.engines.devices import resolved_dtype
from transforms.engines.model import model_folder, model_matryoshka
from transforms.engines.model_files import model_content_hash

_LOG = logging.getLogger("newsvec.serve")
_INLINE_CHARS = 4096  # texts up to this many characters in all are prepared on the event loop
_JSON = "application/json"
_READY_TTL_S = 2.0  # how long /readyz keeps the store's answer
READ_KEY: Any = ...  # create_app's default: the API key read as serve.api_key_* say


def _json(body: Any, status: int = 200, headers: Optional[dict[str, str]] = None) -> Response:
    return Response(orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), status, headers,
                    media_type=_JSON)


def _error(exc: ApiError) -> Response:
    return _json(exc.body(), exc.status, exc.headers)


class Service:
    """What the routes share, made before the app serves: the checked config, the engine and its
    batcher, the text preparation of queries and documents, the corpus, the API key and the
    metrics."""

    def __init__(self, config: Config, engine: ModelHandle, corpus: Optional[Corpus],
                 api_key: Optional[str], metrics: ServeMetrics):
        from pipeline.graph import prepare_text
        from transforms.text import HeadTokenizer

        self.config, self.settings, self.engine = config, config.serve, engine
        self.corpus, self.api_key, self.metrics = corpus, api_key, metrics
        self.label = engine.label()
        self.served = (self.label, config.model.name)
        self.tokenizer = HeadTokenizer(config.model)
        self.prepare = prepare_text(config)
        folder = model_folder(config.model)
        self.matryoshka = model_matryoshka(config.model, folder)  # as the pipeline's engine
        self.content_sha256 = config.model.sha256 or model_content_hash(folder) or None
        self.draining = False
        self.batcher = Batcher(engine.embed, max_batch_tokens=self.settings.max_batch_tokens,
                               max_wait_ms=self.settings.max_wait_ms,
                               max_queue=self.settings.max_queue, metrics=metrics,
                               timeout_s=self.settings.request_timeout_s)

    def query_prompts(self, texts: list[str]) -> list[tuple[int, ...]]:
        """Each query's token ids, as ``newsvec search`` embeds a query: normalized in
        ``text.unicode_form``, after ``model.query_prefix``, the head of its tokens."""
        from transforms.text import normalize_text

        prefix, form = self.config.model.query_prefix, self.config.text.unicode_form
        if self.settings.log_queries:
            for text in texts:
                _LOG.info("query: %r", text)
        return [ids for ids, _ in self.tokenizer.batch(
            [prefix + normalize_text(text, form) for text in texts])]

    def document_prompts(self, texts: list[str]) -> list[tuple[int, ...]]:
        """Each document's token ids, as the pipeline's PrepareText step makes an article's: the
        text up to its first newline is the title, the rest the body (as the pipeline joins
        them); 400 for a text the pipeline would dead-letter, naming the reason."""
        from transforms.types import NewsEvent, PreparedDoc

        if self.config.chunking.doc_vector == "mean" and self.config.chunking.mode != "head":
            raise bad("input_type document: this output's article vectors are the mean of their "
                      "chunks' (chunking.doc_vector: mean), which one engine call does not give",
                      "unsupported_input_type", "input_type")
        events = []
        for i, text in enumerate(texts):
            title, _, body = text.partition("\n")
            events.append(NewsEvent(id=f"input-{i}", title=title, body=body or None))
        prompts = []
        for i, prepared in enumerate(self.prepare.prepare(events)):
            if not isinstance(prepared, PreparedDoc):
                letter = prepared.value  # a TaggedOutput of its dead letter
                raise bad(f"input[{i}] is not one the pipeline embeds ({letter.reason}: "
                          f"{letter.detail})", "unembeddable_input", "input")
            prompts.append(prepared.token_ids)
        if self.settings.log_queries:
            for text in texts:
                _LOG.info("document: %r", text)
        return prompts

    async def prompts(self, texts: list[str], document: bool) -> list[tuple[int, ...]]:
        """``query_prompts`` or ``document_prompts``, in a thread when the texts are long; a
        text that fails to prepare (hostile text the steps raise on) is a 400."""
        make = self.document_prompts if document else self.query_prompts
        try:
            if sum(len(t) for t in texts) <= _INLINE_CHARS:
                return make(texts)
            return await asyncio.to_thread(make, texts)
        except ApiError:
            raise
        except Exception as exc:  # pylint: disable=broad-except  # the text's, never a 500
            raise bad(f"an input could not be prepared: {type(exc).__name__}: {exc}"[:500],
                      "unembeddable_input", "input") from None

    async def embed(self, prompts: list[tuple[int, ...]]) -> list[np.ndarray]:
        """The prompts' vectors through the batcher, in ``serve.request_timeout_s``."""
        try:
            return await asyncio.wait_for(self.batcher.embed(prompts),
                                          self.settings.request_timeout_s)
        except QueueFull as exc:
            raise ApiError(429, f"{exc}; retry after {exc.retry_after_s} s", "queue_full",
                           type_="rate_limit_error",
                           headers={"Retry-After": str(exc.retry_after_s)}) from None
        except asyncio.TimeoutError:
            raise _timeout(self.settings.request_timeout_s) from None
        except InputFailed as exc:
            raise bad(str(exc), "embedding_failed", "input") from None
        except Draining as exc:
            raise ApiError(503, str(exc), "draining", type_="service_unavailable",
                           headers={"Retry-After": "1"}) from None
        except EngineFailedError as exc:
            raise ApiError(503, f"the engine failed: {exc}", "engine_failed",
                           type_="service_unavailable", headers={"Retry-After": "5"}) from None

    def vectors_out(self, vectors: list[np.ndarray], dimensions: Optional[int]
                    ) -> list[np.ndarray]:
        """The vectors at the ``dimensions`` a request asked for (400 where the model has no
        such Matryoshka size)."""
        full = self.config.model.output_dim
        if dimensions is None or dimensions == full:
            return vectors
        if dimensions > full or self.matryoshka is None or not self.matryoshka.allows(
                dimensions):
            raise bad(f"dimensions {dimensions}: this model gives {full}-dimensional vectors and "
                      "declares no Matryoshka size "
                      f"{dimensions} (is_matryoshka, matryoshka_dimensions in its config.json, "
                      "or model.matryoshka_dimensions)",
                      "unsupported_dimensions", "dimensions")
        return [truncate_vector(v, dimensions, self.config.model.normalize) for v in vectors]

    def info(self) -> dict[str, Any]:
        """``GET /info``."""
        config, model = self.config, self.config.model
        return {
            "model": {"name": model.name, "label": self.label,
                      "content_sha256": self.content_sha256, "dim": model.dim,
                      "dimensions": model.output_dim, "dtype": resolved_dtype(model),
                      "normalize": model.normalize, "max_tokens": model.max_tokens,
                      "document_prefix": model.document_prefix,
                      "query_prefix": model.query_prefix,
                      "matryoshka_dimensions": (list(self.matryoshka.dimensions or ())
                                                if self.matryoshka and self.matryoshka.declared
                                                else None)},
            "text": {"unicode_form": config.text.unicode_form},
            "chunking": {"mode": config.chunking.mode, "doc_vector": config.chunking.doc_vector},
            "embedding_signature": signature_of(config),
            "output": config.output, "output_run": output_record(config.output),
            "search": self.corpus.kind if self.corpus is not None else "off",
            "store": ({"kind": config.store.kind, "schema": config.store.schema_name,
                       "table": config.store.table} if config.store.enabled else None),
        }


def _timeout(seconds: float) -> ApiError:
    return ApiError(503, f"not answered within serve.request_timeout_s ({seconds:g} s)",
                    "timeout", type_="service_unavailable", headers={"Retry-After": "1"})


Handler = Callable[[Request], Awaitable[Response]]


def _answered(service: Service, route: str, handler: Handler) -> Handler:
    """``handler`` behind the API key, its answer counted in the metrics, every ``ApiError`` as
    its error body, anything else a 500 with no detail (and the traceback in the log)."""
    metrics = service.metrics

    async def endpoint(request: Request) -> Response:
        started = time.perf_counter()
        metrics.in_flight.inc()
        kind = None
        try:
            auth.check_host(request.headers.get("host"), service.api_key)
            auth.check_request(request.scope["path"], request.headers.get("authorization"),
                               service.api_key)
            response = await handler(request)
        except ApiError as exc:
            response, kind = _error(exc), exc.code
        except ClientDisconnect:  # gone before its body was read: nobody reads the answer
            response, kind = _error(bad("the client went away", "client_disconnected")), \
                "client_disconnected"
        except Exception:  # pylint: disable=broad-except  # a bug: never a client's input
            _LOG.exception("%s failed", route)
            response, kind = _error(ApiError(500, "internal error (see the service's log)",
                                             "internal_error", type_="server_error")), \
                "internal_error"
        finally:
            metrics.in_flight.dec()
        metrics.answered(route, response.status_code, time.perf_counter() - started, kind)
        return response

    endpoint.__name__ = route.strip("/").replace("/", "_") or "root"
    return endpoint


T = TypeVar("T")


async def _unless_gone(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result; cancelled (its inputs not yet in an engine call dropped) as soon as the
    client closes its connection, when nobody would read the answer."""
    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass  # the body was read: the next message is the disconnect

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(gone())
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for each in (watch, task):
            if not each.done():
                each.cancel()
                with contextlib.suppress(BaseException):
                    await each
    if task.cancelled():
        raise ClientDisconnect()
    return task.result()


def _embeddings(service: Service) -> Handler:
    async def embeddings(request: Request) -> Response:
        body = await read_json(request, service.settings.max_body_bytes,
                               service.settings.request_timeout_s)
        asked = embeddings_request(body, service.settings, service.served)
        prompts = await service.prompts(asked.inputs, asked.document)
        vectors = service.vectors_out(await _unless_gone(request, service.embed(prompts)),
                                      asked.dimensions)
        tokens = sum(len(p) for p in prompts)
        data = [{"object": "embedding", "index": i,
                 "embedding": (base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
                               if asked.base64 else v)}
                for i, v in enumerate(vectors)]
        return _json({"object": "list", "data": data, "model": service.label,
                      "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    return embeddings


def _search(service: Service) -> Handler:
    async def search(request: Request) -> Response:
        body = await read_json(request, service.settings.max_body_bytes,
                               service.settings.request_timeout_s)
        asked = search_request(body, service.settings)
        if service.corpus is None:
            raise ApiError(404, "search is off here (serve.search: off)", "search_off",
                           type_="not_found_error")
        (vector,) = await _unless_gone(
            request, service.embed(await service.prompts([asked.query], False)))
        filters = Filters(asked.sources, asked.languages, asked.published_after,
                          asked.published_before)
        try:
            hits = await asyncio.wait_for(asyncio.to_thread(
                service.corpus.nearest, vector, asked.k, asked.all_copies, filters),
                service.settings.request_timeout_s)
        except asyncio.TimeoutError:
            raise _timeout(service.settings.request_timeout_s) from None
        return _json({"object": "list", "data": hits, "model": service.label,
                      "searched": service.corpus.kind})

    return search


def _probes(service: Service) -> dict[str, Handler]:
    async def healthz(request: Request) -> Response:
        return _json({"status": "ok"})

    checked: dict[str, Any] = {"at": -_READY_TTL_S, "problem": None}
    checking = asyncio.Lock()

    async def store_problem() -> Optional[str]:
        """The store's ``ready()``: one check at a time, its answer kept ``_READY_TTL_S`` (a probe
        needs no key: a flood of them must not open a connection each)."""
        corpus = service.corpus
        assert corpus is not None
        async with checking:
            if time.monotonic() - checked["at"] >= _READY_TTL_S:
                checked["problem"] = await asyncio.to_thread(corpus.ready)
                checked["at"] = time.monotonic()
            return checked["problem"]

    async def readyz(request: Request) -> Response:
        if service.draining:
            return _json({"status": "draining"}, 503)
        problem = (await store_problem()
                   if service.corpus is not None and service.corpus.kind == "store" else None)
        try:  # the reasons name the output and the store: for a client with the key only
            auth.check_request("/info", request.headers.get("authorization"), service.api_key)
        except ApiError:
            return _json({"status": "not ready" if problem is not None else "ready"},
                         503 if problem is not None else 200)
        if problem is not None:
            return _json({"status": "not ready", "reason": problem}, 503)
        corpus = service.corpus.ready() if service.corpus is not None else None
        return _json({"status": "ready", **({"search": corpus} if corpus else {})})

    async def info(request: Request) -> Response:
        return _json(await asyncio.to_thread(service.info))

    async def models(request: Request) -> Response:
        return _json({"object": "list", "data": [
            {"id": service.label, "object": "model", "created": 0, "owned_by": "newsvec"}]})

    async def metrics(request: Request) -> Response:
        return Response(service.metrics.exposition(), media_type=ServeMetrics.CONTENT_TYPE)

    return {"/healthz": healthz, "/readyz": readyz, "/info": info, "/v1/models": models,
            "/metrics": metrics}


def create_app(config: Config, engine: Optional[ModelHandle] = None, *,
               api_key: Optional[str] = READ_KEY) -> Starlette:
    """The service for ``config``, ready to serve: its output checked (a ``ConfigError`` naming
    the difference where it was written otherwise: ``pipeline.search.check_output``), its corpus
    read, ``engine`` (default: the process's engine for ``model:``, loaded here) and the API key
    (default: read as ``serve.api_key_*`` say; None: no key). The batcher starts with the app's
    lifespan, on its event loop."""
    metrics = ServeMetrics()
    config, corpus = corpus_for(config)
    if engine is None:
        from transforms.engines.registry import load_engine

        started = time.perf_counter()
        engine = load_engine(config.model)
        metrics.load_ms.set((time.perf_counter() - started) * 1000)
    key = auth.api_key(config.serve) if api_key is READ_KEY else api_key
    service = Service(config, engine, corpus, key, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        service.batcher.start()
        try:
            yield
        finally:
            await service.batcher.close()

    # Starlette itself, with its own routes: FastAPI's app and routes (its dependency machinery,
    # nothing the routes use) answered 10% fewer requests a second in the burst with a modeled
    # engine, and FastAPI's routes 28% fewer from 32 clients (docs/serving.md)
    app = Starlette(lifespan=lifespan)
    app.state.service = service
    routes: dict[str, tuple[str, Handler]] = {
        "/v1/embeddings": ("POST", _embeddings(service)), "/v1/search": ("POST", _search(service)),
        **{path: ("GET", handler) for path, handler in _probes(service).items()},
        **status_routes(service),  # GET /status, /status.json (pipeline.serve.pages)
        **{path: ("GET", handler) for path, handler in search_page.routes().items()}}
    for path, (method, handler) in routes.items():
        app.add_route(path, _answered(service, path, handler), methods=[method])

    async def http_error(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, StarletteHTTPException) else 500
        code = {404: "not_found", 405: "method_not_allowed"}.get(status, "http_error")
        return _error(ApiError(status, str(getattr(exc, "detail", "")), code))

    app.add_exception_handler(StarletteHTTPException, http_error)

    return app
