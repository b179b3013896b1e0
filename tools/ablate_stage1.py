"""Ablation of decode stage 1 on the GPU: variants of one generated module timed side by side.

    python3 tools/ablate_stage1.py [--config configs/k3v4-d128.yaml] [--module OLD.py ...]
                                   [--variants base nokey ...] [--launch 1:32:1:8 ...]
                                   [--shape 1x4096]

Each variant edits the rendered source of the config's module, imports it and
times the whole decode call (CUDA-graph replay) at 32 x 8192 (--shape) for a few
launches, against the copy ceiling of the same run. Variants that drop work
give wrong outputs on purpose: they measure what that work costs.

- base:          the module as rendered
- select:        key centroids by a where-tree over 8 registers instead of a gather
                 (kernels that gather: the slots layout; planes configs look centroids up with prmt)
- nokey:         no key dequantization or key dots (scores = a sum of the key words)
- novalue:       no value dots (the accumulators sum the value words)
- nokey_novalue: both; what remains is loads, addressing and the softmax
- noop:          every split exits at once (what remains is the launches, the seq_lens
                 load and stage 2: the floor at batch 1)
- nocorr:        no norm correction (centroid squares neither summed nor applied; slots layout
                 only: planes stores norm-corrected norms)
- sqdot:         centroid squares summed by a tl.dot of fp16 squares against ones, not by tl.sum
                 (slots layout only)
- capN:          stage 1 compiled with at most N registers per thread (triton's maxnreg), e.g. cap168
- rotate_every_batch: stage 1 rotates the query at every batch (planes MSE configs with the
                 Hadamard rotation; the shipped module does so up to _ROTATE_QUERY_MAX_BATCH)
- --module PATH: extra module files, e.g. rendered from an older commit with
                 `git stash; tqgen render CONFIG > old.py` (set arch: sm90 in the config)
"""

import argparse
import os
import re
import sys
import tempfile

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tqgen import bench, emit, render, testing  # noqa: E402

LAUNCHES = [dict(num_warps=1, block_kv=32, num_splits=8), dict(num_warps=2, block_kv=64, num_splits=16)]
GATHER = re.compile(r"tl\.load\(centroids_ptr \+ \((.*)\)\)$", re.M)  # both layouts' code expressions
SELECT_HELPER = '''
@triton.jit
def _centroid_select(code, c0, c1, c2, c3, c4, c5, c6, c7):
    low = tl.where((code & 2) != 0, tl.where((code & 1) != 0, c3, c2), tl.where((code & 1) != 0, c1, c0))
    high = tl.where((code & 2) != 0, tl.where((code & 1) != 0, c7, c6), tl.where((code & 1) != 0, c5, c4))
    return tl.where((code & 4) != 0, high, low)

'''


def variant(source: str, name: str) -> str:
    edited = source
    if name in ("select", "sqdot") and not GATHER.search(edited):
        raise SystemExit(f"variant {name!r} needs a kernel that gathers centroids (the slots layout)")
    if name == "select":
        edited = edited.replace("@triton.jit\ndef tq_decode_stage1(", SELECT_HELPER + "\n@triton.jit\ndef tq_decode_stage1(")
        loads = "; ".join(f"centroid{i} = tl.load(centroids_ptr + {i})" for i in range(8))
        edited = edited.replace("    table_row_ptr = block_table_ptr", f"    {loads}\n    table_row_ptr = block_table_ptr", 1)
        edited = GATHER.sub(lambda m: f"_centroid_select(({m.group(1)}), " + ", ".join(f"centroid{i}" for i in range(8)) + ")",
                            edited)
    if name == "sqdot":
        groups = re.search(r"query0 = tl\.load\(.*\n", edited) and re.search(r"group = tl\.arange\(0, (\d+)\)", edited).group(1)
        edited = edited.replace("centroid_sq = tl.zeros([BLOCK_KV], tl.float32)",
                                "centroid_sq = tl.zeros([BLOCK_H, BLOCK_KV], tl.float32)")
        edited = re.sub(r"centroid_sq \+= tl\.sum\(centroid \* centroid, axis=1\)\n( *)scores = tl\.dot\((query\d), "
                        r"tl\.trans\(centroid\.to\(tl\.float16\)\), scores\)",
                        r"centroid16 = centroid.to(tl.float16)\n\1centroid_sq = tl.dot(ones_rows, tl.trans(centroid16 * centroid16), "
                        r"centroid_sq)\n\1scores = tl.dot(\2, tl.trans(centroid16), scores)", edited)
        edited = edited.replace("key_norm / tl.sqrt(centroid_sq + 1e-16)", "key_norm / tl.sqrt(tl.max(centroid_sq, axis=0) + 1e-16)")
        edited = edited.replace("    table_row_ptr = block_table_ptr",
                                f"    ones_rows = tl.full([BLOCK_H, {groups}], 1.0, tl.float16)\n    table_row_ptr = block_table_ptr", 1)
    if name == "noop":
        edited = edited.replace("    if split_start >= split_end:\n", "    if split_start >= 0:  # ablation: no split has work\n")
    if name == "nocorr":
        if "centroid_sq" not in edited:
            raise SystemExit("variant 'nocorr' needs a kernel that corrects norms (slots; planes stores them corrected)")
        edited = re.sub(r"\n *centroid_sq (\+)?= .*", "", edited)
        edited = edited.replace("key_norm = key_norm / tl.sqrt(centroid_sq + 1e-16)", "pass")
    if "nokey" in name:
        edited = re.sub(r"key_word = _load_key_words\((.*)\)\n(?:.*\n)*?( *key_norm = _load_fp16)",
                        lambda m: f"scores = tl.zeros([BLOCK_H, BLOCK_KV], tl.float32) + "
                                  f"_load_key_words({m.group(1)}).to(tl.float32).sum(axis=1)[None, :]\n{m.group(2)}",
                        edited)
        edited = edited.replace("key_norm = key_norm / tl.sqrt(centroid_sq + 1e-16)", "pass")
    if "novalue" in name:
        edited = re.sub(r"acc(\d) = tl\.dot\(scaled_probs, .*\n.*acc\d \* rescale\[:, None\]\)",
                        r"acc\1 = acc\1 * rescale[:, None] + tl.sum(value_word, axis=0).to(tl.float32)[None, :]", edited)
    cap = re.fullmatch(r"cap(\d+)", name)
    if cap:
        launch = "BLOCK_KV=block_kv, num_warps=num_warps, num_stages=num_stages)"
        edited = edited.replace(launch, f"{launch[:-1]}, maxnreg={cap.group(1)})")
    if name == "rotate_every_batch":
        edited = re.sub(r"^_ROTATE_QUERY_MAX_BATCH = \d+$", "_ROTATE_QUERY_MAX_BATCH = 1 << 30", edited, flags=re.M)
    if edited == source and name != "base":
        raise SystemExit(f"variant {name!r} matched nothing in this module (a template changed?)")
    return edited


def import_source(source: str, tag: str, folder: str):
    path = os.path.join(folder, f"ablate_{tag}.py")
    with open(path, "w") as handle:
        handle.write(source)
    return emit.import_module_file(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/k3v4-d128.yaml")
    parser.add_argument("--module", nargs="*", default=[], help="extra module files to time")
    parser.add_argument("--variants", nargs="+", default=["base", "select", "nokey", "novalue", "nokey_novalue"])
    parser.add_argument("--launch", nargs="+", default=[],
                        help="launches as warps:block_kv:stages:splits (default: kv32 w1 sp8, kv64 w2 sp16, 1 stage)")
    parser.add_argument("--shape", default="32x8192", help="batch x context (default 32x8192)")
    args = parser.parse_args()
    launches = [dict(zip(("num_warps", "block_kv", "num_stages", "num_splits"), map(int, text.split(":"))))
                for text in args.launch] or [dict(launch, num_stages=1) for launch in LAUNCHES]
    config = emit.as_config(args.config)
    source = render.render(config)
    batch, context = map(int, args.shape.split("x"))
    ceiling = bench.copy_ceiling_gbps()
    print(f"copy ceiling {ceiling:.0f} GB/s; {config.name} at {batch} x {context}; graph replay", flush=True)
    folder = tempfile.mkdtemp(prefix="tqgen-ablate-")
    modules = [(name, import_source(variant(source, name), name, folder)) for name in args.variants]
    modules += [(os.path.basename(path), import_source(open(path).read(), f"extra{i}", folder))
                for i, path in enumerate(args.module)]
    problem = testing.random_problem(modules[0][1], config, batch, context, 32, 8, "cuda")
    inputs = [problem[k] for k in ("query", "cache", "block_table", "seq_lens")]
    reference = modules[0][1].decode(*inputs, **launches[0])
    out = torch.empty_like(inputs[0])
    nbytes = batch * 8 * context * modules[0][1].SLOT_BYTES
    print("| variant | launch | us | % of ceiling | max error vs base |\n|---|---|---|---|---|")
    for name, module in modules:
        workspace = module.DecodeWorkspace(batch, 32, 64, "cuda")
        got = module.decode(*inputs, **launches[0])
        error = ((got.float() - reference.float()).abs().max() / reference.float().abs().max()).item()
        for launch in launches:
            def call(launch=launch):
                module.decode(*inputs, out=out, workspace=workspace, validate=False, **launch)
            call()
            ms = triton.testing.do_bench_cudagraph(call, return_mode="median")
            percent = 100 * nbytes / (ms * 1e-3) / 1e9 / ceiling
            label = f"kv{launch['block_kv']} w{launch['num_warps']} st{launch['num_stages']} sp{launch['num_splits']}"
            print(f"| {name} | {label} | {ms * 1e3:.1f} | {percent:.1f} | {error:.1e} |", flush=True)


if __name__ == "__main__":
    main()
