"""Run the whole decode call a few times per config, for a profiler to attach to.

    ncu --clock-control none -k regex:tq_decode_stage1 -s 2 -c 1 --section SpeedOfLight \\
        --section Occupancy --section WarpStateStats --section SchedulerStats --section LaunchStats \\
        python3 tools/profile_decode.py 32x16384 configs/k3v4-d128-planes.yaml [--variant load_only]
        [--block-kv 32 --stages 2 --splits 16] [--q-heads 128]

Each config decodes a random full-length batch (`tqgen.testing.random_problem`, 32 query heads unless
--q-heads, 8 KV heads) at its tuned or heuristic launch (or the launch fields given), three times: `-s 2`
skips the first two stage-1 launches, which include compilation. --variant renders a stage-1 experiment of
tools/stage1_variants.py instead of the shipped kernel. --q-len N runs decode_multi with N query tokens a sequence
instead (its own launch, or the launch fields given; --warps 4 --stages 3 the warpgroup kernel where the module has
one, `-k regex:tq_decode_multi_stage1` for ncu); --wg-columns N lets that kernel take programs of N-32 columns
(shipped: 17), e.g. q_len 2 x 4 heads (q_len 1 runs decode's own kernels whatever the launch):

    TQGEN_NCU_KERNEL=tq_decode_multi_stage1_wg TQGEN_PROFILE_ARGS="--q-len 2 --wg-columns 1 --block-kv 128 \
        --stages 3 --warps 4 --splits 16" bash tools/ncu_stage1.sh OUT 1x4096 configs/k4v4-d128-planes.yaml
"""

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tqgen  # noqa: E402
from bench_decode_multi import widen_warpgroup_columns  # noqa: E402 (beside this file)
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
parser.add_argument("--warps", type=int)
parser.add_argument("--q-heads", type=int, default=32, help="query heads over 8 KV heads")
parser.add_argument("--q-len", type=int, help="run decode_multi with this many query tokens a sequence")
parser.add_argument("--wg-columns", type=int, help="the warpgroup kernel takes programs of N-32 columns")
args = parser.parse_args()
if args.wg_columns is not None and (args.q_len or 1) == 1:
    parser.error("--wg-columns: q_len 1 runs decode's own kernels whatever the launch; the warpgroup kernel takes "
                 "--q-len 2 up")
batch, context = map(int, args.shape.split("x"))
for path in args.configs:
    config = emit.as_config(path)
    if args.variant == "shipped":
        module = tqgen.load(config)
    else:
        config = config_mod.resolve_arch(config, None)
        [(_, module)] = variant_modules(config, tempfile.mkdtemp(prefix="tqgen-profile-"), (args.variant,))
    problem = testing.random_problem(module, config, batch, context, args.q_heads, 8, "cuda")
    group_size = args.q_heads // 8
    device = problem["cache"].device
    if args.wg_columns is not None:
        widen_warpgroup_columns(module, args.wg_columns)
    if args.q_len:
        entry, query = "decode_multi", problem["query"][:, None].expand(-1, args.q_len, -1, -1).contiguous()
        launch = module.decode_multi_launch(batch, 8, group_size, args.q_len, context, device)
    else:
        entry, query = "decode", problem["query"]
        launch = module.decode_launch(batch, 8, group_size, context, device)
    launch = dict(zip(LAUNCH_FIELDS, launch))
    out = torch.empty_like(query)
    workspace = module.DecodeWorkspace(batch, args.q_heads, 64, "cuda", max_q_len=max(1, args.q_len or 1))
    for name, value in (("block_kv", args.block_kv), ("num_stages", args.stages), ("num_splits", args.splits),
                        ("num_warps", args.warps)):
        if value:
            launch[name] = value
    for _ in range(3):
        getattr(module, entry)(query, problem["cache"], problem["block_table"], problem["seq_lens"], out=out,
                               workspace=workspace, validate=False, max_seq_len=context, **launch,
                               **testing.codebook_kwargs(module, "cuda"))
    torch.cuda.synchronize()
    print(f"{path} ({args.variant}): {entry} at {batch} x {context}, {launch}, ran 3 times", flush=True)
