"""What a launcher that waited for its batch job adds to the job's summary: timings and micro-batch
statistics, from the job's Beam metrics.

The counts and the accounting check are not here: the job's own last step (``transforms.commit``)
counts what it wrote in storage and writes ``_summary.json``, on Dataflow as locally.
"""
from __future__ import annotations

from collections import defaultdict

from apache_beam.metrics.metric import MetricsFilter

from transforms import metrics


def _value(result):
    return result.committed if result.committed is not None else result.attempted


def read_metrics(job_result) -> tuple[dict, dict, dict]:
    """(newsvec counters, dead letters by reason, distributions as
    {name: {count, sum, min, max}})."""
    query = job_result.metrics().query(MetricsFilter())
    counters: defaultdict[str, int] = defaultdict(int)
    reasons: defaultdict[str, int] = defaultdict(int)
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


def _skip_timings(counters: dict, dists: dict) -> dict:
    """An incremental run's: the longest load of the previous outputs' keys (once per process), the
    longest wait of the skip for one, and the skip's CPU time per article."""
    if not counters.get("skip_lookups"):
        return {}
    return {"key_index_load_s": round((dists.get("key_index_load_ms", {}).get("max") or 0)
                                      / 1000, 3),
            "key_index_wait_s": round((dists.get("key_index_wait_ms", {}).get("max") or 0)
                                      / 1000, 3),
            "skip_us_per_article": round(counters.get("skip_ns", 0)
                                         / counters["skip_lookups"] / 1000, 2)}


def job_statistics(job_result, token_budget: int, timings: dict[str, float]) -> dict:
    """{"batches": ..., "timings": ...} of a finished job."""
    counters, _, dists = read_metrics(job_result)
    docs = dists.get("batch_docs", {"count": 0, "sum": 0})
    tokens = dists.get("batch_tokens", {"count": 0, "sum": 0})
    n_batches = docs["count"]
    mean_tokens = tokens["sum"] / n_batches if n_batches else 0.0
    return {
        "batches": {
            "count": n_batches,
            "mean_docs": docs["sum"] / n_batches if n_batches else 0.0,
            "mean_tokens": mean_tokens,
            "max_tokens": tokens.get("max"),
            "mean_fill": mean_tokens / token_budget,
        },
        "timings": {
            **{k: round(v, 3) for k, v in timings.items()},
            "model_load_s": round(dists.get("model_load_ms", {}).get("sum", 0) / 1000, 3),
            "model_loads": dists.get("model_load_ms", {}).get("count", 0),
            "embed_s": round(dists.get("embed_batch_ms", {}).get("sum", 0) / 1000, 3),
            **_skip_timings(counters, dists),
        },
    }
