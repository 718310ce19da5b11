"""The servers ``benchmarks.serve`` measures newsvec serve against, besides ``vllm serve``: each
answers OpenAI's ``POST /v1/embeddings`` on loopback, and ``GET /healthz`` once it is ready.

- ``st``: the design's "before": one FastAPI process that embeds each request as it comes with
  sentence-transformers (no batching across requests), as the team's home-made server did;
- ``constant``: a trivial FastAPI server that answers a constant vector: the ceiling of HTTP and
  the client on this machine;
- ``modeled``: newsvec serve itself (``create_app``, the config's tokenizer and text preparation)
  in front of a MODELED engine, not a model: each call sleeps, holding no GIL, for its queries at
  ``--qps`` queries/s (``ModeledQueries``), as an engine on a GPU or a CPU with bf16 would compute
  while the CPU goes on: what the service's own side can carry when the engine is not the limit.

``python -m benchmarks.serve_peers st|constant|modeled --port P [--model DIR --dtype D]
[--config C --qps Q]``."""
from __future__ import annotations

import argparse

import uvicorn
from fastapi import FastAPI, Request


def _answer(vectors: list[list[float]], model: str, tokens: int) -> dict:
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": v}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def st_app(model_dir: str, dtype: str, name: str) -> FastAPI:
    import torch
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_dir, device="cpu", model_kwargs={
        "torch_dtype": {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]})
    app = FastAPI()

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": True}

    @app.post("/v1/embeddings")
    def embeddings(body: dict) -> dict:  # a sync route: FastAPI runs it in its thread pool
        texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
        vectors = model.encode(texts, normalize_embeddings=True, convert_to_numpy=True)
        return _answer([v.astype(float).tolist() for v in vectors], name, 0)

    return app


def constant_app(dim: int, name: str) -> FastAPI:
    vector = [1.0 / dim ** 0.5] * dim
    app = FastAPI()

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"ok": True}

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> dict:
        body = await request.json()
        texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
        return _answer([vector] * len(texts), name, 0)

    return app


class ModeledQueries:
    """MODELED engine, not a model: ``embed`` sleeps ``len(prompts) / qps`` (no GIL held) and
    returns one fixed unit vector per prompt."""

    def __init__(self, dim: int, qps: float, name: str):
        import numpy as np

        self._qps, self._name = qps, name
        self._vector = np.eye(1, dim, dtype=np.float32)[0]

    def label(self) -> str:
        return self._name

    def take_load_ms(self) -> list[int]:
        return []

    def embed(self, prompts):
        import time

        time.sleep(len(prompts) / self._qps)
        return [self._vector] * len(prompts)


def modeled_app(config_path: str, qps: float, name: str):
    from pipeline.config import load
    from pipeline.serve.app import create_app

    config = load(config_path)
    return create_app(config, ModeledQueries(config.model.output_dim, qps, name), api_key=None)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serve_peers")
    parser.add_argument("peer", choices=["st", "constant", "modeled"])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", help="the model's folder (st)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--name", default="model")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--config", help="the served config (modeled)")
    parser.add_argument("--qps", type=float, default=987.0,
                        help="the modeled engine's queries/s (modeled)")
    args = parser.parse_args()
    if args.peer == "st":
        app = st_app(args.model, args.dtype, args.name)
    elif args.peer == "modeled":
        app = modeled_app(args.config, args.qps, args.name)
    else:
        app = constant_app(args.dim, args.name)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False,
                backlog=4096)


if __name__ == "__main__":
    main()
