"""Rotary position embedding, the one rule every adapter applies (harness.model.spec, "attention").

Each head's query and key at position t become x * cos + x[partner] * signed_sin: dimension i turns with its pair
partner[i] by the angle t * base^(-2f/Dh) of its frequency f. The two pairings in use differ only in which
dimensions pair: "half" (Hugging Face's rotate_half: Llama, Mistral, GPT-NeoX) pairs i with i + Dh/2 and repeats
the frequencies as [f_0 .. f_{Dh/2-1}, f_0 .. f_{Dh/2-1}]; "interleaved" (GPT-J, Meta's reference Llama) pairs 2f
with 2f + 1. Weights trained under one pairing are wrong under the other, and nothing fails: the pitfall spec
tests/specs/pitfall_rotary.yaml holds each framework to the one it is given.

The tables are computed here in float64, from the frequencies as Hugging Face computes them (base^(2f/Dh) inverted),
and an adapter takes them in its run's parameter dtype (float32, float64 in fp64 runs), cast to q's dtype when it
multiplies: Hugging Face computes its tables in float32 and casts them to the query's dtype.
"""
from __future__ import annotations

import numpy as np


def rotary_tables(length: int, head_dim: int, base: float, pairing: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(cos [T, Dh], signed_sin [T, Dh], partner [Dh] int64) for positions 0 .. T-1."""
    half = head_dim // 2
    inverse = 1.0 / base ** (np.arange(half, dtype=np.float64) * 2 / head_dim)
    angles = np.arange(length, dtype=np.float64)[:, None] * inverse  # [T, Dh/2]
    i = np.arange(head_dim)
    if pairing == "half":
        frequency, partner, sign = i % half, (i + half) % head_dim, np.where(i < half, -1.0, 1.0)
    else:
        frequency, partner, sign = i // 2, i ^ 1, np.where(i % 2 == 0, -1.0, 1.0)
    return np.cos(angles[:, frequency]), sign * np.sin(angles[:, frequency]), partner.astype(np.int64)


def rotate(x: np.ndarray, cos: np.ndarray, signed_sin: np.ndarray, partner: np.ndarray) -> np.ndarray:
    """x [..., T, Dh] rotated (the reference's form of what each adapter writes in its own ops)."""
    return x * cos + x[..., partner] * signed_sin
