"""Fit the decode heuristic's split rule to a config's committed tuning table.

    python3 tools/fit_split_rule.py CONFIG [--device NVIDIA_H200] [--group-size 4] [--tile 32] [--warps 1]
                                    [--stages 2] [--top 8]

For each rule of a grid -- _split_count(programs, sm_count, context, programs_per_sm, tokens_per_split,
min_split_tokens), capped at `cap` splits once batch x KV heads reaches the SM count (0: no cap) -- the launch
(tile, warps, stages, splits) it gives every bucket of one group size of the table is looked up among the bucket's
timed candidates (with the query rotated in stage 1 where the bucket timed both rotations, as the heuristic rotates
a 16-bit query), and its time divided by the bucket's best. Prints the rules whose picks were all timed, best
geometric mean first, with the worst ratio: what a heuristic of that family would cost against the tuner. The
formula is the built module's own _split_count; the SM count is the table's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPO = Path(__file__).resolve().parent.parent

GRID = dict(programs_per_sm=(4, 8, 16, 32), tokens_per_split=(512, 1024, 2048, 4096),
            min_split_tokens=(32, 64, 128, 256), cap=(0, 8, 16, 32))


def rule_costs(module, table: dict, tile: int, warps: int, stages: int, group_size: int = 4,
               num_kv_heads: int = 8) -> list[tuple]:
    """[(geomean, worst, programs_per_sm, tokens_per_split, min_split_tokens, cap)] of every rule of GRID whose picks
    were all timed in the `group_size` buckets of `table` (a tuned file's JSON), best geomean first."""
    from tqgen import tuned_files
    from tqgen.buckets import bucket_bounds

    sm_count = table["metadata"]["sm_count"]
    buckets = [(bucket_bounds(key), entry) for key, entry in table["buckets"].items()]
    buckets = [(bounds, entry) for bounds, entry in buckets if bounds["group_size"] == group_size]
    results = []
    for per_sm, per_split, least, cap in itertools.product(*GRID.values()):
        ratios = []
        for bounds, entry in buckets:
            batch, context = bounds["batch"][1], bounds["context"][1]
            programs = max(1, batch * num_kv_heads)
            splits = module._split_count(programs, sm_count, context, per_sm, per_split, least, full_cap=cap or 64)
            launch = dict(zip(tuned_files.LAUNCH_FIELDS, (tile, warps, stages, splits)))
            name = tuned_files.candidate_id(launch)
            timed = entry["timings_us"].get(name, entry["timings_us"].get(f"{name}_rq"))
            if timed is None:
                break
            ratios.append(timed / entry["best_us"])
        else:
            geomean = math.exp(sum(map(math.log, ratios)) / len(ratios))
            results.append((geomean, max(ratios), per_sm, per_split, least, cap))
    return sorted(results)


def table_folders(device: str) -> tuple[Path, Path]:
    """Where one GPU's timing tables are, in the order to read them: tuned/DEVICE (the files builds bake), then
    docs/tuning-tables/DEVICE (tables of kernels since re-tuned on another GPU)."""
    return REPO / "tuned" / device, REPO / "docs" / "tuning-tables" / device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--device", default="NVIDIA_H200",
                        help="the GPU folder to read: tuned/DEVICE, else docs/tuning-tables/DEVICE (tables of kernels "
                             "since re-tuned on another GPU)")
    parser.add_argument("--group-size", type=int, default=4, help="the query heads per KV head of the buckets fitted")
    parser.add_argument("--tile", type=int, default=32)
    parser.add_argument("--warps", type=int, default=1)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()

    import tqgen
    from tqgen import config as config_mod

    config = config_mod.resolve_arch(config_mod.load(args.config), (9, 0))
    folders = table_folders(args.device)
    found = [path for path in (folder / f"{config.artifact_name()}.json" for folder in folders) if path.is_file()]
    if not found:
        raise SystemExit(f"fit_split_rule: no tuned file {config.artifact_name()}.json in "
                         f"{' or '.join(str(folder) for folder in folders)}")
    path = found[0]
    module = tqgen.load(config, tempfile.mkdtemp(prefix="tqgen-fit-"))
    results = rule_costs(module, json.loads(path.read_text()), args.tile, args.warps, args.stages, args.group_size)
    if not results:
        raise SystemExit(f"fit_split_rule: no rule's picks were all timed in {path.name} (g{args.group_size}, "
                         f"kv{args.tile}_w{args.warps}_st{args.stages})")
    print(f"{path.name}: g{args.group_size}, kv{args.tile}_w{args.warps}_st{args.stages}, {len(results)} rules with "
          "every pick timed")
    print("| geomean | worst | programs per SM | tokens per split | min split tokens | cap |")
    print("|---|---|---|---|---|---|")
    for geomean, worst, *rule in results[:args.top]:
        print(f"| {geomean:.3f} | {worst:.3f} | " + " | ".join(map(str, rule)) + " |")


if __name__ == "__main__":
    main()
