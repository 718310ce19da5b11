"""Vector arithmetic that both the engines and the chunk vectors use: a sequence's vector pooled
from its tokens' as the model pools (``pool_tokens``), and L2 normalization (``normalized``)."""
from __future__ import annotations

import numpy as np


def pool_tokens(tokens: np.ndarray, pooling: str) -> np.ndarray:
    """A sequence's vector from its tokens' (``n x dim``) as the model pools: ``mean`` over all
    of them (special tokens included, as sentence-transformers' attention mask does), ``cls``
    (the first) or ``last``; not normalized."""
    if pooling == "mean":
        return tokens.astype(np.float64).mean(axis=0).astype(np.float32)
    if pooling == "cls":
        return np.array(tokens[0], dtype=np.float32)
    if pooling == "last":
        return np.array(tokens[-1], dtype=np.float32)
    raise ValueError(f"cannot pool tokens as {pooling!r}: mean, cls or last")


def normalized(vector: np.ndarray, normalize: bool = True) -> np.ndarray:
    """``vector`` as float32, L2-normalized if ``normalize`` (a zero vector stays zero)."""
    vector = np.asarray(vector, dtype=np.float64)
    norm = float(np.linalg.norm(vector)) if normalize else 0.0
    return (vector / norm if norm else vector).astype(np.float32)
