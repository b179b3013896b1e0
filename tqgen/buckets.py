"""Shape buckets: which tuned launch a decode call uses.

A bucket is (query heads per KV head, batch rounded up to a power of two,
context rounded up to a power of two), named like `g4_b32_t8192`. The context
of a call is the longest sequence the block table can hold (known on the
host without reading seq_lens), or the caller's `max_seq_len` hint when given.

A call's batch is counted in (sequence, KV head) pairs over the KV heads the
launches were timed at (`bucket_batch`): a launch's grid is one program per pair
and split, so 32 sequences of 32 KV heads run the grid that 128 sequences of 8
were timed on.

`bucket_key` and `bucket_batch` are copied verbatim into every emitted module by
render.py, so the tuner and the modules bucket shapes identically.
"""

from __future__ import annotations

import itertools
import re

# Copied into every emitted module by render.py (one source of truth).
EMBEDDED = ("bucket_key", "bucket_batch")

DEFAULT_BATCHES = (1, 2, 4, 8, 32, 64, 128)
DEFAULT_CONTEXTS = (1024, 4096, 16384, 65536)
# Query heads per KV head: MHA (1), Llama-3-8B and its kin (4), Llama-3-70B, Qwen3 and GPT-OSS (8), 128 / 8 (16).
DEFAULT_GROUP_SIZES = (1, 4, 8, 16)
# The KV heads every bucket is timed over (`tqgen tune --kv-heads`; a tuned file's buckets share one count).
DEFAULT_KV_HEADS = 8
# What bucket_key writes (a tuned file's bucket keys are checked against it).
BUCKET_KEY_PATTERN = re.compile(r"g\d+_b\d+_t\d+")


def bucket_key(group_size, batch, context):
    """'g{group}_b{batch rounded up to 2**k}_t{context rounded up to 2**k, at least 256}'."""
    batch_bucket = 1 << max(0, int(batch) - 1).bit_length()
    context_bucket = max(256, 1 << max(0, int(context) - 1).bit_length())
    return f"g{int(group_size)}_b{batch_bucket}_t{context_bucket}"


def bucket_batch(batch, num_kv_heads, tuned_kv_heads):
    """The batch whose bucket holds the tuned launch of a call of `batch` sequences and `num_kv_heads` KV heads,
    for launches timed over `tuned_kv_heads`: the call's (sequence, KV head) pairs in sequences of that many, rounded
    up, at least 1 (fewer pairs than one timed sequence holds take the smallest batch's launch). Either count None
    (a caller that does not say, a table that does not): the batch as it is."""
    if num_kv_heads is None or not tuned_kv_heads:
        return batch
    return max(1, -(-int(batch) * int(num_kv_heads) // int(tuned_kv_heads)))


def bucket_bounds(key: str) -> dict:
    """The shapes a bucket key covers: {'group_size', 'batch': [lo, hi], 'context': [lo, hi]}."""
    group, batch, context = (int(part[1:]) for part in key.split("_"))
    return {"group_size": group,
            "batch": [batch // 2 + 1 if batch > 1 else 1, batch],
            "context": [context // 2 + 1 if context > 256 else 1, context]}


def default_buckets(group_sizes=DEFAULT_GROUP_SIZES, batches=DEFAULT_BATCHES, contexts=DEFAULT_CONTEXTS):
    """(group_size, batch, context) triples, one per bucket, each at the top of its bucket."""
    keys = {}
    for group, batch, context in itertools.product(group_sizes, batches, contexts):
        keys.setdefault(bucket_key(group, batch, context), (group, batch, context))
    return list(keys.values())


def bucket_sort_key(key: str) -> tuple:
    """Order bucket keys numerically (g4_b8_t1024 before g4_b32_t256)."""
    numbers = re.findall(r"\d+", key)
    return tuple(int(n) for n in numbers) if numbers else (key,)
