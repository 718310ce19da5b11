"""``GET /metrics``: the service's Prometheus metrics, in a registry of its own (never the
process's default one, which other libraries fill).

Where a metric means what one of Beam RunInference's metrics means
(``apache_beam.ml.inference.base._MetricsCollector``), it has its name under the ``newsvec_``
prefix: ``num_inferences`` (inputs embedded), ``failed_batches_counter`` (engine calls that
failed), ``inference_request_batch_size`` (inputs per engine call),
``inference_batch_latency_micro_secs`` (an engine call's time, in microseconds) and
``load_model_latency_milli_secs``. Prometheus adds ``_total`` to a counter's name, and
``_bucket``, ``_sum`` and ``_count`` to a histogram's (Beam's distributions). The rest are the
service's own, under ``newsvec_serve_``: requests by route and status, errors by kind (the error
body's ``code``), the latency of a request by route, tokens per engine call, the inputs waiting
for the engine and the requests in flight.
"""
from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_ENGINE_US = tuple(1000 * ms for ms in (1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 10000))
_INPUTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
_TOKENS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 65536)


class ServeMetrics:
    """The service's metrics (see the module), each process's own."""

    CONTENT_TYPE = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("newsvec_serve_requests", "HTTP requests answered, by route and "
                                "status", ["route", "status"], registry=r)
        self.errors = Counter("newsvec_serve_errors", "requests answered with an error, by kind "
                              "(the error's code)", ["kind"], registry=r)
        self.latency = Histogram("newsvec_serve_request_latency_seconds", "time from a request "
                                 "read to its answer, by route", ["route"], buckets=_LATENCY_S,
                                 registry=r)
        self.in_flight = Gauge("newsvec_serve_requests_in_flight", "requests being answered",
                               registry=r)
        self.queue_depth = Gauge("newsvec_serve_queue_depth", "inputs waiting for an engine "
                                 "call", registry=r)
        self.inferences = Counter("newsvec_num_inferences", "inputs embedded (RunInference's "
                                  "num_inferences)", registry=r)
        self.failed_batches = Counter("newsvec_failed_batches_counter", "engine calls that "
                                      "failed (RunInference's failed_batches_counter)",
                                      registry=r)
        self.batch_size = Histogram("newsvec_inference_request_batch_size", "inputs per engine "
                                    "call (RunInference's inference_request_batch_size)",
                                    buckets=_INPUTS, registry=r)
        self.batch_tokens = Histogram("newsvec_serve_batch_tokens", "tokens per engine call",
                                      buckets=_TOKENS, registry=r)
        self.engine_us = Histogram("newsvec_inference_batch_latency_micro_secs", "an engine "
                                   "call's time in microseconds (RunInference's "
                                   "inference_batch_latency_micro_secs)", buckets=_ENGINE_US,
                                   registry=r)
        self.load_ms = Gauge("newsvec_load_model_latency_milli_secs", "how long loading the "
                             "model took (RunInference's load_model_latency_milli_secs)",
                             registry=r)

    def engine_call(self, inputs: int, tokens: int, seconds: float) -> None:
        self.inferences.inc(inputs)
        self.batch_size.observe(inputs)
        self.batch_tokens.observe(tokens)
        self.engine_us.observe(seconds * 1e6)

    def answered(self, route: str, status: int, seconds: float, kind: str | None = None) -> None:
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)
        if kind is not None:
            self.errors.labels(kind).inc()

    def exposition(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return generate_latest(self.registry)
