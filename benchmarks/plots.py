"""PNG plots of benchmark results, written next to their JSON (``<name>-<time>.png``).

- batch (``make benchmark``): articles/s per engine: raw ``LLM.embed()``, the pipeline,
  sentence-transformers;
- streaming (``make benchmark-streaming``): articles/s at saturation against the batch pipeline,
  and the publish-to-Parquet latency distribution at half saturation and at light traffic;
- soak (``make soak``): memory over time, and the latency distribution.
``python -m benchmarks.plots bench-results/<file>.json`` draws one again.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no screen
    import matplotlib.pyplot as plt

    return plt


def _bars(ax, values: dict[str, float], title: str, unit: str = "articles/s") -> None:
    names, heights = list(values), list(values.values())
    bars = ax.bar(names, heights, color=["#4c72b0", "#dd8452", "#55a868", "#c44e52"][:len(names)])
    ax.bar_label(bars, labels=[f"{h:.1f}" for h in heights])
    ax.set_ylabel(unit)
    ax.set_title(title)
    ax.tick_params(axis="x", labelrotation=15)


def batch(results: dict, path: Path) -> Path:
    plt = _pyplot()
    values = {"raw LLM.embed()": results["raw_llm_embed"]["docs_per_s"],
              "newsvec pipeline": results["pipeline"]["docs_per_s"]}
    for dtype, st in (results.get("sentence_transformers") or {}).items():
        values[f"sentence-transformers {dtype}"] = st["docs_per_s"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    _bars(ax, values, f"Batch, {results['docs']} BBC articles, medians of {results['runs']} runs "
                      f"({results['model']['dtype']})")
    return _save(fig, path)


def streaming(results: dict, path: Path) -> Path:
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    _bars(left, {"streaming at saturation": results["saturation"]["docs_per_s"],
                 "batch pipeline": results["batch_pipeline_docs_per_s"]},
          "Streaming against batch (local runner)")
    for key, label in (("latency", "half saturation"), ("latency_light", "light traffic")):
        values = results[key].get("latencies_s")
        if values:
            right.hist(values, bins=30, alpha=0.6,
                       label=f"{label} ({results[key]['rate_docs_per_s']:.1f}/s): p50 "
                             f"{results[key]['p50_s']:.1f} s, p95 {results[key]['p95_s']:.1f} s")
    right.set_xlabel("publish to visible Parquet file (s)")
    right.set_ylabel("articles")
    right.set_title("Latency")
    right.legend(fontsize=8)
    return _save(fig, path)


def soak(results: dict, path: Path) -> Path:
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    samples = results["memory_mib"]["samples"]
    left.plot([s / 60 for s, _ in samples], [m for _, m in samples])
    left.set_xlabel("minutes")
    left.set_ylabel("resident memory (MiB)")
    left.set_title(f"Memory over a {results['soak']['minutes']:g}-minute soak at "
                   f"{results['soak']['rate_msgs_per_s']:.1f} msg/s")
    values = results["latency_s"].get("values")
    if values:
        right.hist(values, bins=40)
    lat = results["latency_s"]
    right.set_title(f"Latency: p50 {lat['p50']:.1f} s, p95 {lat['p95']:.1f} s, "
                    f"p99 {lat['p99']:.1f} s")
    right.set_xlabel("publish to visible Parquet file (s)")
    right.set_ylabel("articles")
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    png = Path(path).with_suffix(".png")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    _pyplot().close(fig)
    return png


def plot(json_path: Path) -> Path:
    """The plot of a results file, by its name (batch-, streaming-, soak-)."""
    results = json.loads(Path(json_path).read_text())
    results = results.get("figures", results)  # a run kept by benchmarks.record
    kind = Path(json_path).name.split("-", 1)[0]
    return {"batch": batch, "streaming": streaming, "soak": soak}[kind](results, Path(json_path))


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(plot(Path(name)))
