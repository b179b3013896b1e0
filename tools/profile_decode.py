"""Run the whole decode call a few times per config, for a profiler to attach to.

    ncu --clock-control none -k regex:tq_decode_stage1 -s 2 -c 1 --section SpeedOfLight \\
        --section Occupancy --section WarpStateStats --section SchedulerStats --section LaunchStats \\
        python3 tools/profile_decode.py 32x16384 configs/k3v4-d128-planes.yaml [--variant load_only]
        [--block-kv 32 --stages 2 --splits 16] [--q-heads 128]

Each config decodes a random full-length batch (`tqgen.testing.random_problem`, 32 query heads unless
--q-heads, 8 KV heads) at its tuned or heuristic launch (or the launch fields given), three times: `-s 2`
skips the first two stage-1 launches, which include compilation. --variant renders a stage-1 experiment of
tools/stage1_variants.py instead of the shipped kernel.
"""

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tqgen  # noqa: E402
from stage1_variants import variant_modules  # noqa: E402 (beside this file)
from tqgen import config as config_mod, emit, testing  # noqa: E402
from tqgen.tuned_files import LAUNCH_FIELDS  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("shape", help="BATCHxCONTEXT")
parser.add_argument("configs", nargs="+")
parser.add_argument("--variant", default="shipped")
parser.add_argument("--block-kv", type=int)
parser.add_argument("--stages", type=int)
parser.add_argument("--splits", type=int)
parser.add_argument("--q-heads", type=int, default=32, help="query heads over 8 KV heads")
args = parser.parse_args()
batch, context = map(int, args.shape.split("x"))
for path in args.configs:
    config = emit.as_config(path)
    if args.variant == "shipped":
        module = tqgen.load(config)
    else:
        config = config_mod.resolve_arch(config, None)
        [(_, module)] = variant_modules(config, tempfile.mkdtemp(prefix="tqgen-profile-"), (args.variant,))
    problem = testing.random_problem(module, config, batch, context, args.q_heads, 8, "cuda")
    out = torch.empty_like(problem["query"])
    workspace = module.DecodeWorkspace(batch, args.q_heads, 64, "cuda")
    group_size = args.q_heads // 8
    launch = dict(zip(LAUNCH_FIELDS, module.decode_launch(batch, 8, group_size, context, problem["cache"].device)))
    for name, value in (("block_kv", args.block_kv), ("num_stages", args.stages), ("num_splits", args.splits)):
        if value:
            launch[name] = value
    for _ in range(3):
        module.decode(problem["query"], problem["cache"], problem["block_table"], problem["seq_lens"], out=out,
                      workspace=workspace, validate=False, max_seq_len=context, **launch,
                      **testing.codebook_kwargs(module, "cuda"))
    torch.cuda.synchronize()
    print(f"{path} ({args.variant}): decode at {batch} x {context}, {launch}, ran 3 times", flush=True)
