"""The run summary, ``<output>/_summary.json``: counts, model and settings, timings.

Counts come from the job's Beam metrics, so they are what the workers really did. The accounting
invariant ``in = written + dead_lettered + duplicates`` is checked here, and a run that breaks it fails.
"""
from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics.metric import MetricsFilter

from pipeline.config import Config
from transforms import metrics
from transforms.model import model_content_hash, resolve_model_path
from transforms.sinks import SUMMARY_FILE, join_path


class AccountingError(RuntimeError):
    """Some input is neither written, dead-lettered nor a counted duplicate."""


def _value(result):
    return result.committed if result.committed is not None else result.attempted


def read_metrics(job_result) -> tuple[dict, dict, dict]:
    """(newsvec counters, dead letters by reason, distributions as {name: {count, sum, min, max}})."""
    query = job_result.metrics().query(MetricsFilter())
    counters, reasons = defaultdict(int), defaultdict(int)
    for result in query["counters"]:
        namespace, name = result.key.metric.namespace, result.key.metric.name
        if namespace == metrics.NAMESPACE:
            counters[name] += _value(result) or 0
        elif namespace == metrics.DEAD_LETTER_NAMESPACE:
            reasons[name] += _value(result) or 0
    dists: dict[str, dict] = {}
    for result in query["distributions"]:
        if result.key.metric.namespace != metrics.NAMESPACE or _value(result) is None:
            continue
        value, name = _value(result), result.key.metric.name
        agg = dists.setdefault(name, {"count": 0, "sum": 0, "min": None, "max": None})
        agg["count"] += value.count
        agg["sum"] += value.sum
        agg["min"] = value.min if agg["min"] is None else min(agg["min"], value.min)
        agg["max"] = value.max if agg["max"] is None else max(agg["max"], value.max)
    return dict(counters), dict(reasons), dists


def build_summary(job_result, config: Config, run_id: str, timings: dict[str, float]) -> dict:
    counters, reasons, dists = read_metrics(job_result)
    counts = {
        "in": counters.get("events_in", 0),
        "written": counters.get("rows_written", 0),
        "dead_lettered": counters.get("dead_lettered", 0),
        "dead_lettered_by_reason": dict(sorted(reasons.items())),
        "duplicates": counters.get("duplicates", 0),
        "truncated": counters.get("truncated", 0),
    }
    counts["accounted"] = counts["written"] + counts["dead_lettered"] + counts["duplicates"]
    docs = dists.get("batch_docs", {"count": 0, "sum": 0})
    tokens = dists.get("batch_tokens", {"count": 0, "sum": 0})
    n_batches = docs["count"]
    mean_tokens = tokens["sum"] / n_batches if n_batches else 0.0
    model_path = resolve_model_path(config.model.path)
    return {
        "run_id": run_id,
        "input": config.input,
        "output": config.output,
        "counts": counts,
        "invariant_holds": counts["in"] == counts["accounted"],
        "model": {**config.model.model_dump(), "resolved_path": model_path,
                  "content_sha256": model_content_hash(model_path) or None},
        "batches": {
            "count": n_batches,
            "mean_docs": docs["sum"] / n_batches if n_batches else 0.0,
            "mean_tokens": mean_tokens,
            "max_tokens": tokens.get("max"),
            "mean_fill": mean_tokens / config.model.token_budget,
        },
        "timings": {
            **{k: round(v, 3) for k, v in timings.items()},
            "model_load_s": round(dists.get("model_load_ms", {}).get("sum", 0) / 1000, 3),
            "model_loads": dists.get("model_load_ms", {}).get("count", 0),
            "embed_s": round(dists.get("embed_batch_ms", {}).get("sum", 0) / 1000, 3),
        },
    }


def write_summary(output: str, summary: dict[str, Any]) -> str:
    path = join_path(output, SUMMARY_FILE)
    with FileSystems.create(path, mime_type="application/json") as f:
        f.write(json.dumps(summary, indent=2, default=str).encode("utf-8"))
    return path
