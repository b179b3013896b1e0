"""`tqgen bench --json` output as BENCHMARKS.md's tables: one per preset and cache layout.

    python3 tools/bench_tables.py BENCH.json [BENCH.json ...]

Decode rows: shape, whole-call time (CUDA-graph replay), % of the copy ceiling measured in
the same run, and the speedup over fp16 SDPA of the same shape in that run. Store and
dequantize rows: shape, time, % of the ceiling (bytes read + written).
"""

from __future__ import annotations

import collections
import json
import sys


def tables(documents: list[dict]) -> str:
    decode = collections.defaultdict(list)
    ops = collections.defaultdict(list)
    runs, layouts = [], {}
    for document in documents:
        meta = document["metadata"]
        # Each config's cache layout as the run recorded it (earlier runs did not: then its name says it).
        layouts.update({name: fields["cache_layout"] for name, fields in meta.get("configs", {}).items()})
        runs.append(f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}, "
                    f"{meta['q_heads']}/{meta['kv_heads']} heads, copy ceiling {document['copy_ceiling_gbps']:.0f} GB/s")
        for row in document["rows"]:  # a table per config and head count: rows of other head counts are not comparable
            decode[row["config"], meta["q_heads"], meta["kv_heads"]].append(row)
        for row in document.get("op_rows", []):  # their bytes scale with the KV heads: a run of other heads says so
            heads = "" if meta["kv_heads"] == 8 else f", {meta['kv_heads']} KV heads"
            ops[row["config"]].append({**row, "shape": row["shape"] + heads})

    def layout(config):
        return layouts.get(config, "planes" if config.endswith("planes") else "slots")

    lines = [f"Runs: {'; '.join(runs)}.", ""]
    for key in sorted(decode, key=lambda key: (layout(key[0]) == "planes", key)):
        config, q_heads, kv_heads = key
        heads = "" if (q_heads, kv_heads) == (32, 8) else f", {q_heads}/{kv_heads} heads"  # BENCHMARKS.md's default
        lines += [f"### {config.split('-')[0]}, {layout(config)} ({config}{heads})", "",
                  "| batch x context | us | % of ceiling | x fp16 SDPA | fp16 SDPA us | launch |", "|---|---|---|---|---|---|"]
        for row in sorted(decode[key], key=lambda r: (r["batch"], r["context"])):
            # x fp16 SDPA from the two graph replays printed beside it (earlier bench versions stored SDPA's time
            # over the faster of the decode's plain and graph times).
            lines.append(f"| {row['batch']} x {row['context']} | {row['graph_us']:.1f} | {row['ceiling_pct']:.1f} "
                         f"| {row['sdpa_us'] / row['graph_us']:.2f} | {row['sdpa_us']:.1f} | {row['launch']} |")
        lines.append("")
    if ops:
        lines += ["### store and dequantize", "", "| config | op | shape | us | % of ceiling |", "|---|---|---|---|---|"]
        for config in sorted(ops):
            for row in ops[config]:
                lines.append(f"| {config} | {row['op']} | {row['shape']} | {row['graph_us']:.1f} | {row['ceiling_pct']:.1f} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(tables([json.load(open(path)) for path in sys.argv[1:]]))
