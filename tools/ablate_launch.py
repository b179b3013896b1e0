"""Dependent (programmatic) launches of the decode kernels on the GPU: variants timed side by side.

    python3 tools/ablate_launch.py configs/k3v4-d128-planes.yaml:1x4096 \
        configs/k8v4-d128-planes.yaml:2x4096:64,1,1,64 ... [--variants serial dependent ...]

Each argument is CONFIG:BATCHxCONTEXT[:BLOCK_KV,WARPS,STAGES,SPLITS] (default: the module's
own launch for the shape). Every variant edits the rendered module, then the whole decode
call is timed as a CUDA-graph replay in 3 rounds that alternate the variants (the table
gives the median). Before each round's first call the workspace and the output are filled
with NaN, and that call's output is compared bit for bit with the serial variant's. The
variants other than `serial` launch dependently at any batch (the shipped module does so
at batch 1 only):

- serial:        every kernel launched in stream order (DEPENDENT_LAUNCH = False)
- dependent:     the shipped kernels: stage 1 signals stage 2 after its loop
- early_trigger: stage 1 signals stage 2 at the start of each program
- no_trigger:    stage 1 never signals: stage 2 launches as stage 1's programs exit
- stage2_serial: stage 2 launched in stream order (only MSE stage 1 launches dependently;
                 with fp8 keys nothing does, so this is serial again: a noise check)
"""

import argparse
import os
import statistics
import sys
import tempfile

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tqgen import bench, emit, render, testing  # noqa: E402
from tqgen.tuned_files import LAUNCH_FIELDS  # noqa: E402

from ablate_stage1 import import_source  # noqa: E402  (beside this file)

TRIGGER = "        tl.extra.cuda.gdc_launch_dependents()\n"
EVERY_BATCH = ("_DEPENDENT_LAUNCH_MAX_BATCH = 1\n", "_DEPENDENT_LAUNCH_MAX_BATCH = 1 << 30\n")
# The module's sections of stage 1 merging its own splits and of decode_multi render the stage-1 templates (and
# decode_multi the stage-2 launch) again: the edits below are to decode's kernels and launcher, which come before.
MULTI_TOKEN_SECTION = "# decode_multi: several query tokens per sequence"
MERGED_SECTION = "# Stage 1 merging its own splits"
SECTIONS_AFTER = (MERGED_SECTION, MULTI_TOKEN_SECTION)


def _late_trigger(source: str) -> str:
    """The `if DEPENDENT_LAUNCH:` block in stage 1 that holds the trigger (comment lines included)."""
    end = source.index(TRIGGER) + len(TRIGGER)
    start = source.rindex("    if DEPENDENT_LAUNCH:\n", 0, end)
    return source[start:end]


def variant(source: str, name: str) -> str:
    cut = min([source.find(section) for section in SECTIONS_AFTER if section in source] or [len(source)])
    return _decode_variant(source[:cut], name) + source[cut:]


def _decode_variant(source: str, name: str) -> str:
    if name == "serial":
        edits = [('DEPENDENT_LAUNCH = os.environ.get("TQGEN_DEPENDENT_LAUNCH", "1") != "0"',
                  "DEPENDENT_LAUNCH = False")]
    else:
        edits = [EVERY_BATCH]
        trigger = _late_trigger(source)
        if name == "early_trigger":
            edits += [(trigger, ""), ("    split = tl.program_id(2)\n",
                                      "    split = tl.program_id(2)\n    if DEPENDENT_LAUNCH:\n" + TRIGGER)]
        elif name == "no_trigger":
            edits += [(trigger, "")]
        elif name == "stage2_serial":
            edits += [("num_warps=4, launch_pdl=dependent))", "num_warps=4, launch_pdl=False))")]  # _stage2_keywords
        elif name != "dependent":
            raise SystemExit(f"unknown variant {name!r}")
    for old, new in edits:
        if source.count(old) != 1:
            raise SystemExit(f"variant {name!r}: {old.strip()[:60]!r} is not in the module once (a template changed?)")
        source = source.replace(old, new)
    return source


def time_item(item: str, names: list[str], folder: str) -> str:
    config_path, shape, *launch = item.split(":")
    batch, context = map(int, shape.split("x"))
    config = emit.as_config(config_path)
    source = render.render(config)
    modules = {name: import_source(variant(source, name), f"{config.name}_{name}".replace("-", "_"), folder)
               for name in names}
    first = modules[names[0]]
    problem = testing.random_problem(first, config, batch, context, 32, 8, "cuda")
    inputs = [problem[k] for k in ("query", "cache", "block_table", "seq_lens")]
    chosen = dict(zip(LAUNCH_FIELDS, map(int, launch[0].split(",")))) if launch else dict(
        zip(LAUNCH_FIELDS, first.decode_launch(batch, 8, 4, context, torch.device("cuda"))))
    out = torch.empty_like(inputs[0])
    workspace = first.DecodeWorkspace(batch, 32, 64, "cuda")
    times = {name: [] for name in names}
    outputs = {}
    for _ in range(3):
        for name, module in modules.items():
            def call(module=module):
                module.decode(*inputs, out=out, workspace=workspace, validate=False, max_seq_len=context, **chosen)
            for buffer in [out, *(b for b in vars(workspace).values() if isinstance(b, torch.Tensor))]:
                buffer.fill_(float("nan"))
            call()
            torch.cuda.synchronize()
            outputs[name] = out.clone()
            times[name].append(triton.testing.do_bench_cudagraph(call, return_mode="median") * 1e3)
    baseline = outputs.get("serial", outputs[names[0]])
    cells = [f"{statistics.median(times[n]):.2f}{'' if torch.equal(outputs[n], baseline) else ' (bits differ!)'}"
             for n in names]
    label = "kv{block_kv} w{num_warps} st{num_stages} sp{num_splits}".format(**chosen)
    return f"| {config.name} | {batch} x {context} | {label} | " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("items", nargs="+", metavar="CONFIG:BxT[:KV,W,ST,SP]")
    parser.add_argument("--variants", nargs="+",
                        default=["serial", "dependent", "early_trigger", "no_trigger", "stage2_serial"])
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="tqgen-launch-")
    print("us per decode call (CUDA-graph replay, median of 3 alternating rounds)")
    print("| config | batch x context | launch | " + " | ".join(args.variants) + " |")
    print("|---" * (3 + len(args.variants)) + "|")
    for item in args.items:
        print(time_item(item, args.variants, folder), flush=True)


if __name__ == "__main__":
    main()
