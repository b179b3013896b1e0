"""`tqgen tune`: pick the decode launch per shape bucket on this GPU.

For each bucket (query heads per KV head, batch, context) the tuner times
every candidate launch (BLOCK_KV, num_warps, num_stages, split count) as a
whole decode call (the split count changes stage 2 too), after checking that
candidate's output against the float64 reference on a reduced copy of the
problem (at most 2 sequences of at most 2048 tokens). The problem is drawn
from a fixed seed (PROBLEM_SEED), so re-runs time and check the same data,
and the caller's random state is left alone. Candidates that fail
to compile or differ from the reference are recorded as rejected. Each
finished bucket is saved at once (tuned_files.save_bucket: lock, merge, atomic
replace), so a killed run keeps what it finished and a re-run resumes.
With a shortlist (`tqgen tune --shortlist K`, after a kernel change), a bucket
times only the K launches that were fastest in the file's earlier tune, and the
launches that tune did not know.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch

from . import reference, tuned_files
from .buckets import DEFAULT_KV_HEADS, bucket_bounds, bucket_key
from .config import Config
from .errors import TqgenError
from .layout import Layout
from .testing import DECODE_TOLERANCE, codebook_kwargs, random_problem, relative_error

CHECK_BATCH, CHECK_CONTEXT = 2, 2048
# Every bucket is timed and checked on data drawn from this seed, so a tune is reproducible. The
# check's relative error depends on the data (where the softmax-weighted mean of the values nearly
# cancels, the same absolute error is a larger fraction of a smaller norm): over 300 fresh draws of
# k3v4 at head_dim 64, batch 1 x 256 tokens, it reached 1.08e-3 of the 1.5e-3 limit, and a CI run
# on fresh draws once rejected every candidate of that bucket.
PROBLEM_SEED = 0
# Screening (`tqgen tune`'s default): every candidate is timed by a 5 ms CUDA-graph run, then the finalists within
# 5% of the fastest (at most 8) by the full 20 ms run. On the H200 (k3v4 planes, 32 x 16384, 24 candidates,
# 2026-12-04) the 5 ms medians were within 2% of the 20 ms ones (two 20 ms runs: within 1.5%) and took
# 0.03-0.05 s a candidate against 0.09-0.21 s.
SCREEN_MARGIN, SCREEN_FINALISTS, SCREEN_REP_MS = 0.05, 8, 5
# Compile classes are drawn at no more than this context (compile_classes).
COMPILE_CONTEXT = 4096


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    block_kv: tuple[int, ...] = (32, 64)
    num_warps: tuple[int, ...] = (1, 2, 4)
    num_stages: tuple[int, ...] = (1, 2)
    # 128: it won batch 1 x 65536 for the MSE planes presets; 256 lost everywhere (docs/tuning.md).
    num_splits: tuple[int, ...] = (4, 8, 16, 32, 64, 128)
    # How each launch merges its splits, up to a module's _MERGE_IN_STAGE1_MAX_BATCH sequences (merges()): False
    # by stage 2, True by stage 1 itself (decode's merge_in_stage1). (False,) times stage 2 alone there too.
    merge_in_stage1: tuple[bool, ...] = (False, True)
    # Merging in stage 1 only for launches of at most this many splits (None: every launch): the last program's
    # one warp reads every split's partials, so the merge costs more with each split.
    merge_max_splits: int | None = None
    # Where the query is rotated, up to a module's _ROTATE_QUERY_MAX_BATCH sequences (rotations()): True in stage 1,
    # False by tq_prepare_query first. (True,) times stage 1's rotation alone.
    rotate_query: tuple[bool, ...] = (True, False)
    # Also time, in each bucket, the launch the module's heuristic gives its shape (heuristic_candidates).
    heuristic: bool = True

    def candidates(self, rotations: tuple = (None,), merges: tuple = (None,)) -> list[dict]:
        """Every launch of the space, each once per entry of rotations (True, False: with decode's
        rotate_query set so; None: without it) and of merges (decode's merge_in_stage1 likewise; a merge in
        stage 1 only for launches of at most merge_max_splits splits)."""
        launches = [dict(zip(tuned_files.LAUNCH_FIELDS, values))
                    for values in itertools.product(self.block_kv, self.num_warps, self.num_stages, self.num_splits)]
        with_rotation = [launch if rotate is None else {**launch, tuned_files.ROTATE_FIELD: rotate}
                         for rotate in rotations for launch in launches]
        return [launch if merge is None else {**launch, tuned_files.MERGE_FIELD: merge}
                for merge in merges for launch in with_rotation
                if not (merge and self.merge_max_splits is not None and launch["num_splits"] > self.merge_max_splits)]


def rotations(module: ModuleType, batch: int, ways: tuple = (True, False)) -> tuple:
    """Where stage 1 can rotate the query (modules with query_rotated_in_stage1, up to their
    _ROTATE_QUERY_MAX_BATCH sequences, at every context), each of `ways` is timed (True: in stage 1, False:
    tq_prepare_query first) and the bucket's winner decides; elsewhere decode has one way."""
    if hasattr(module, "query_rotated_in_stage1") and batch <= module._ROTATE_QUERY_MAX_BATCH:
        return tuple(ways)
    return (None,)


def merges(module: ModuleType, batch: int, ways: tuple = (False, True)) -> tuple:
    """Up to the module's _MERGE_IN_STAGE1_MAX_BATCH sequences each of `ways` to merge the splits is timed (False:
    stage 2, True: stage 1 itself, decode's merge_in_stage1) and the bucket's winner decides; above, and where
    `ways` is stage 2 alone, decode's own choice (stage 2) with no field in the tuned launch."""
    if tuple(ways) != (False,) and hasattr(module, "merged_in_stage1") and batch <= module._MERGE_IN_STAGE1_MAX_BATCH:
        return tuple(ways)
    return (None,)


def bucket_candidates(module: ModuleType, space: SearchSpace, batch: int) -> list[dict]:
    """The candidates the tuner times for a bucket of `batch` sequences: the space's launches, each with every
    query rotation (rotations) and split merge (merges) that decode has a choice of at that batch."""
    return space.candidates(rotations(module, batch, space.rotate_query), merges(module, batch, space.merge_in_stage1))


def heuristic_candidates(module: ModuleType, space: SearchSpace, group_size: int, batch: int, context: int,
                         num_kv_heads: int, device) -> list[dict]:
    """The launch an untuned bucket of this shape would run (the module's decode_launch_defaults on this device),
    with each query rotation and split merge decode has a choice of there, as bucket_candidates gives the space's:
    timed beside them, so a tuned bucket is never slower by the tuner's own clock than no tuning (the heuristic
    derives split counts the space may lack, such as 6 for one wave of 12 programs an SM)."""
    block_kv, num_warps, num_stages, num_splits = module.decode_launch_defaults(batch, num_kv_heads, group_size,
                                                                                context, device)
    own = dataclasses.replace(space, block_kv=(block_kv,), num_warps=(num_warps,), num_stages=(num_stages,),
                              num_splits=(num_splits,))
    return bucket_candidates(module, own, batch)


def shortlist(launches: list[dict], earlier: dict | None, size: int) -> list[dict]:
    """What a bucket times under `tqgen tune --shortlist size`: of `launches`, those of the `size` launches fastest in
    `earlier` (the bucket's entry in an earlier tune of the file, on an earlier kernel), fastest first, then every
    launch that entry neither timed nor rejected (new to the search space). Where the earlier tune had no choice of
    the query's rotation, or of the split merge, each choice of a launch counts as that launch (the earlier one ran
    decode's own way): the merge of a launch that was slow is not timed, that of a fast one is. All of `launches`
    where the entry timed none of them."""
    timings = (earlier or {}).get("timings_us") or {}
    rejected = (earlier or {}).get("rejected")
    seen = set(timings) | (set(rejected) if isinstance(rejected, dict) else set())
    # The optional fields the earlier tune's ids never carried.
    carried = {field for name in seen for field in tuned_files.launch_of_id(name) or {}}
    unknown = {tuned_files.ROTATE_FIELD, tuned_files.MERGE_FIELD} - carried

    def earlier_name(launch: dict) -> str:
        name = tuned_files.candidate_id(launch)
        if name in seen:
            return name
        return tuned_files.candidate_id({field: value for field, value in launch.items() if field not in unknown})

    names = [(earlier_name(launch), launch) for launch in launches]
    fastest = sorted({name for name, _ in names if name in timings}, key=lambda name: (timings[name], name))[:size]
    if not fastest:
        return launches
    rank = {name: index for index, name in enumerate(fastest)}
    chosen = sorted((pair for pair in names if pair[0] in rank), key=lambda pair: rank[pair[0]])
    return [launch for _, launch in chosen] + [launch for name, launch in names if name not in seen]


def cuda_graph_timer(fn: Callable[[], object]) -> float:
    """Median milliseconds of a CUDA-graph replay of fn (decode is launch-bound at small sizes)."""
    import triton

    return triton.testing.do_bench_cudagraph(fn, return_mode="median")


def cuda_graph_screen_timer(fn: Callable[[], object]) -> float:
    """cuda_graph_timer over a quarter of its run (SCREEN_REP_MS): a candidate's screening time."""
    import triton

    return triton.testing.do_bench_cudagraph(fn, rep=SCREEN_REP_MS, return_mode="median")


def _bucket_problem(module: ModuleType, config: Config, group_size: int, batch: int, context: int,
                    num_kv_heads: int, max_splits: int, device) -> dict:
    """One bucket's timed problem (drawn from PROBLEM_SEED), the reduced copy its candidates are checked on,
    the codebook arguments, the output and the workspace (room for max_splits, the space's most)."""
    generator = torch.Generator(device=device).manual_seed(PROBLEM_SEED)
    # A slots cache is timed as make_cache and vLLM allocate it (head-major).
    problem = random_problem(module, config, batch, context, num_kv_heads * group_size, num_kv_heads, device,
                             generator)
    # The check reads a copy of the blocks its sequences use (the reference converts the whole cache
    # it is given: a planes cache at 32 x 65536 would take tens of GB).
    check_pages = (CHECK_CONTEXT + config.block_size - 1) // config.block_size
    check_blocks = problem["block_table"][:CHECK_BATCH, :check_pages]
    check = {"query": problem["query"][:CHECK_BATCH], "cache": problem["cache"][check_blocks.flatten().long()],
             "block_table": torch.arange(check_blocks.numel(), dtype=torch.int32, device=device).view(check_blocks.shape),
             "seq_lens": problem["seq_lens"][:CHECK_BATCH].clamp(max=CHECK_CONTEXT)}
    return {"problem": problem, "check": check, "codebook": codebook_kwargs(module, device),
            "out": torch.empty_like(problem["query"]),
            "workspace": module.DecodeWorkspace(batch, problem["query"].shape[1], max_splits, device)}


def _candidate_calls(module: ModuleType, setup: dict, launch: dict) -> tuple[Callable, Callable]:
    """(check, call) of one candidate launch: decode of the reduced copy (returns its output) and of the whole
    problem into the bucket's output and workspace (what is timed)."""
    check, problem, codebook = setup["check"], setup["problem"], setup["codebook"]

    def run_check():
        return module.decode(check["query"], check["cache"], check["block_table"], check["seq_lens"],
                             validate=False, **launch, **codebook)

    def call():
        module.decode(problem["query"], problem["cache"], problem["block_table"], problem["seq_lens"],
                      out=setup["out"], workspace=setup["workspace"], validate=False, **launch, **codebook)

    return run_check, call


def tune_bucket(module: ModuleType, config: Config, group_size: int, batch: int, context: int,
                space: SearchSpace, *, timer: Callable, screen_timer: Callable | None = None,
                num_kv_heads: int = DEFAULT_KV_HEADS, device="cuda", launches: list[dict] | None = None) -> dict:
    """Time every candidate of one bucket (`launches`, default the space's: bucket_candidates); returns the
    bucket's entry for the tuned file.

    With screen_timer, every candidate is timed by it (a short run) and only the finalists, those within
    SCREEN_MARGIN of the fastest (at most SCREEN_FINALISTS), again by timer; the entry's timings_us then
    holds the finalists' timer results and the others' screening results, `retimed` names the finalists,
    and the best is the fastest finalist.
    """
    started = time.monotonic()
    if launches is None:
        launches = bucket_candidates(module, space, batch)
    setup = _bucket_problem(module, config, group_size, batch, context, num_kv_heads, _most_splits(space, launches),
                            device)
    check = setup["check"]
    expected = reference.decode(Layout.from_config(config), check["query"], check["cache"], check["block_table"],
                                check["seq_lens"], setup["codebook"].get("rotation"), setup["codebook"].get("centroids"))
    limit = DECODE_TOLERANCE[torch.float16]
    timings, rejected, calls = {}, {}, {}
    named = {tuned_files.candidate_id(launch): launch for launch in launches}
    for name, launch in named.items():
        try:
            run_check, call = _candidate_calls(module, setup, launch)
            got = run_check()
            error = relative_error(got, expected)
            if not (error <= limit and torch.isfinite(got).all()):
                rejected[name] = f"relative error {error:.2e} against the reference (limit {limit:.2g})"
                continue
            call()
            timings[name] = round((screen_timer or timer)(call) * 1e3, 2)
            calls[name] = call
        except Exception as exc:  # a candidate that cannot compile or launch is a result, not a crash
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            rejected[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    if not timings:
        raise TqgenError(f"bucket {bucket_key(group_size, batch, context)}: every candidate was rejected "
                         f"({next(iter(rejected.values()), 'no candidates')})")
    retimed, finalists = {}, list(timings)
    if screen_timer is not None:
        fastest = min(timings.values())
        finalists = sorted((name for name, us in timings.items() if us <= fastest * (1 + SCREEN_MARGIN)),
                           key=timings.get)[:SCREEN_FINALISTS]
        retimed = {"retimed": finalists}
        for name in finalists:
            timings[name] = round(timer(calls[name]) * 1e3, 2)
    # Among the finalists: the others' timings are screenings, which the full run may read a few percent below.
    best_name = min(finalists, key=timings.get)
    best = named[best_name]
    return {
        **bucket_bounds(bucket_key(group_size, batch, context)),
        "shape": {"batch": batch, "context": context, "num_kv_heads": num_kv_heads},
        "best": best,
        "best_us": timings[best_name],
        "timings_us": dict(sorted(timings.items(), key=lambda item: item[1])),
        **retimed,
        "rejected": rejected,
        "seconds": round(time.monotonic() - started, 1),
    }


def compile_classes(shapes) -> list[tuple[int, int, int]]:
    """The (group size, batch, context) problems whose candidates compile every kernel that the buckets
    `shapes` (group size, batch, context) will run: one per group size and batch, at its smallest context
    (at most 4096 tokens). A launch's kernels specialize on the group size, the batch (dependent launches
    and the query's rotation in stage 1 are chosen by it, and a batch of 1 is a constant of its own) and
    the launch, not on the context: every argument that grows with it (pages per sequence, blocks) is
    a multiple of 16 from 256 tokens on, which is all triton specializes on."""
    smallest: dict[tuple[int, int], int] = {}
    for group_size, batch, context in shapes:
        smallest[(group_size, batch)] = min(context, smallest.get((group_size, batch), context))
    return [(group_size, batch, min(context, COMPILE_CONTEXT)) for (group_size, batch), context in smallest.items()]


def _class_launches(shapes, launches_of: dict | None, group_size: int, batch: int) -> list[dict] | None:
    """Every launch that some shape of this group size and batch times, once each (None: the space's)."""
    if launches_of is None:
        return None
    union: dict[str, dict] = {}
    for shape in shapes:
        if tuple(shape[:2]) == (group_size, batch):
            for launch in launches_of[tuple(shape)]:
                union.setdefault(tuned_files.candidate_id(launch), launch)
    return list(union.values())


def _compile_class(module_file: str, config: Config, group_size: int, batch: int, context: int,
                   space: SearchSpace, num_kv_heads: int, device: str, launches: list[dict] | None = None) -> int:
    """In a worker process: run each candidate of one compile class once (its check and its whole call), so
    that triton compiles their kernels into its on-disk cache, where the tuning process then finds them.
    `launches`: the candidates (default the space's, bucket_candidates). Returns how many failed (the tuner
    records why when it meets them)."""
    module = _loaded_module(module_file)
    if launches is None:
        launches = bucket_candidates(module, space, batch)
    setup = _bucket_problem(module, config, group_size, batch, context, num_kv_heads, _most_splits(space, launches),
                            device)
    failed = 0
    for launch in launches:
        try:
            for run in _candidate_calls(module, setup, launch):
                run()
        except Exception:  # noqa: BLE001 (recorded by the tuner itself, in series)
            failed += 1
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)
    return failed


def _most_splits(space: SearchSpace, launches: list[dict]) -> int:
    """The splits a bucket's workspace holds: the most of the space's and of the launches timed (the heuristic's
    may exceed the space's)."""
    return max([*space.num_splits, *(launch["num_splits"] for launch in launches)])


def _loaded_module(module_file: str) -> ModuleType:
    """The emitted module at module_file, imported in this process."""
    from . import emit

    return emit.load(module_file)


def precompile(module: ModuleType, config: Config, shapes, space: SearchSpace, *, workers: int,
               num_kv_heads: int = DEFAULT_KV_HEADS, device="cuda", progress: Callable[[str], None] = print,
               launches_of: dict[tuple[int, int, int], list[dict]] | None = None) -> None:
    """Compile the kernels of every candidate of the buckets `shapes` in `workers` processes side by side,
    before they are timed in series: compiling took about half of a tune on the H200 (one process compiles
    one kernel at a time, 30-40 s in each of the first buckets of a group size). Triton's on-disk cache
    hands the kernels to the tuning process. A worker that fails costs only time: whatever it did not
    compile is compiled when first timed. `launches_of` maps a shape to the candidates it times (default: the
    space's); a class compiles every launch that one of its shapes times."""
    import concurrent.futures
    import multiprocessing

    classes = compile_classes(shapes)
    workers = min(workers, len(classes))
    if workers < 2 or not str(device).startswith("cuda"):
        return
    started = time.monotonic()
    progress(f"compiling the candidates of {len(classes)} (group size, batch) classes in {workers} processes")
    context = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
    failures = []
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        jobs = {pool.submit(_compile_class, module.__file__, config, group_size, batch, ctx, space, num_kv_heads,
                            str(device), launches=_class_launches(shapes, launches_of, group_size, batch)):
                (group_size, batch) for group_size, batch, ctx in classes}
        try:
            for job in concurrent.futures.as_completed(jobs):
                try:
                    job.result()
                except Exception as exc:  # noqa: BLE001 (a lost worker: its kernels compile in series)
                    failures.append(f"g{jobs[job][0]} b{jobs[job][1]}: {type(exc).__name__}: {str(exc)[:120]}")
        except BaseException:  # Ctrl-C: the pool's exit would wait for every class still queued, compiling each
            pool.shutdown(cancel_futures=True)
            raise
    note = f"; not compiled ahead (compiled when timed): {'; '.join(failures)}" if failures else ""
    progress(f"compiled in {time.monotonic() - started:.0f} s{note}")


def _bucket_launches(module: ModuleType, space: SearchSpace, todo: dict, num_kv_heads: int, device) -> dict:
    """Each shape of the buckets `todo` (key -> shape) -> its candidates: the space's (bucket_candidates) and, with
    space.heuristic, the heuristic's (heuristic_candidates), each launch once."""
    launches_of = {}
    for shape in todo.values():
        launches = bucket_candidates(module, space, shape[1])
        if space.heuristic:
            launches = list({tuned_files.candidate_id(launch): launch for launch in
                             launches + heuristic_candidates(module, space, *shape, num_kv_heads, device)}.values())
        launches_of[shape] = launches
    return launches_of


def _shortlisted_launches(launches_of: dict, todo: dict, earlier: dict,
                          shortlist_size: int | None) -> tuple[dict, dict]:
    """(what each shape of `todo` times, and per shortlisted key the record its entry keeps): a bucket that an earlier
    tune timed (`earlier`: key -> (entry, what the record says of its source)) its shortlist of launches_of[shape],
    the others all of it."""
    timed_of, shortlisted = dict(launches_of), {}
    for key, shape in todo.items():
        if key in earlier:
            entry, source = earlier[key]
            chosen = shortlist(launches_of[shape], entry, shortlist_size)
            if len(chosen) < len(launches_of[shape]):
                shortlisted[key] = {"size": shortlist_size, "of": len(launches_of[shape]), **source}
            timed_of[shape] = chosen
    return timed_of, shortlisted


def tune(config: Config, module: ModuleType, buckets: list[tuple[int, int, int]], space: SearchSpace, *,
         root: Path, fingerprint: dict, timer: Callable = cuda_graph_timer, screen_timer: Callable | None = None,
         num_kv_heads: int = DEFAULT_KV_HEADS, device="cuda", force: bool = False, compile_workers: int = 1,
         shortlist_size: int | None = None, shortlist_from: Path | None = None,
         progress: Callable[[str], None] = print) -> Path:
    """Tune the buckets not yet in the file (all with force=True); returns the tuned file's path.

    screen_timer: see tune_bucket. compile_workers > 1 compiles the candidates' kernels in that many
    processes first (precompile; CUDA devices only). shortlist_size: a bucket that an earlier tune of the file
    timed (tuned_files.earlier_buckets) times only its shortlist (shortlist), and its entry says so (`shortlist`);
    shortlist_from: a tuned file of this config from another GPU (or setup) whose timings shortlist the buckets
    the file's own earlier tunes lack (its entry's `shortlist` then names that GPU, `from_device`).

    A file that is corrupt or tuned for another setup (kernel, triton, device) is refused,
    or with force=True renamed to NAME.json.replaced-TIME (tuned_files.set_aside_unusable) and re-tuned.
    """
    if getattr(module, "DEPENDENT_LAUNCH", True) is False:
        # The batch-1 buckets are timed with the dependent launches serving uses.
        raise TqgenError("tuning times decode as it is served: unset TQGEN_DEPENDENT_LAUNCH=0 "
                         "(or module.DEPENDENT_LAUNCH = False) first")
    metadata = tuned_files.make_metadata(config, fingerprint)
    path = tuned_files.tuned_path(root, metadata["device_name"], config)
    tuned_files.check_writable(path)  # else the first bucket's minutes of timing end in an error saving it
    # Read before a --force sets the file aside (earlier_buckets reads the files set aside too).
    # Each bucket's earlier entry and what its `shortlist` record says of it: this GPU's own tunes first.
    earlier = {}
    if shortlist_size:
        for key, (entry, kernel_hash) in tuned_files.earlier_buckets(path, metadata["device_name"]).items():
            earlier[key] = (entry, {"from_kernel_hash": kernel_hash})
    if shortlist_size and shortlist_from is not None:
        device_name, table = tuned_files.table_buckets(shortlist_from, config)
        for key, (entry, kernel_hash) in table.items():
            earlier.setdefault(key, (entry, {"from_kernel_hash": kernel_hash, "from_device": device_name}))
    if shortlist_size and not earlier:
        progress(f"no earlier tune of {path.name} to shortlist from: every candidate is timed")
    try:
        done = tuned_files.read(path, metadata)
    except tuned_files.Unusable as exc:
        if not force:
            raise TqgenError(f"not overwriting {exc}; re-tune with --force (which keeps that file as "
                             f"{path.name}.replaced-TIME) or move it away") from None
        kept, done = tuned_files.set_aside_unusable(path, metadata)
        if kept is not None:
            progress(f"{exc}: kept as {kept.name}, re-tuning every bucket")
    timed = tuned_files.buckets_kv_heads(done)
    if timed is not None and num_kv_heads != timed:  # save_bucket would refuse the first bucket after its timing
        raise TqgenError(f"{path} holds buckets timed over {timed} KV heads; --kv-heads {num_kv_heads} would "
                         f"mix the two (a module counts a call's batch in KV head pairs over one count): tune into "
                         f"another --tuned-dir, or move the file away")
    # Tune at the top of each bucket, once per bucket.
    shapes: dict[str, tuple[int, int, int]] = {}
    for group_size, batch, context in buckets:
        key = bucket_key(group_size, batch, context)
        bounds = bucket_bounds(key)
        shapes.setdefault(key, (group_size, bounds["batch"][1], bounds["context"][1]))
    total = len(shapes)
    todo = {key: shape for key, shape in shapes.items() if force or key not in done}
    every_launch = _bucket_launches(module, space, todo, num_kv_heads, device)
    launches_of, shortlisted = _shortlisted_launches(every_launch, todo, earlier, shortlist_size)
    if todo and compile_workers > 1:
        precompile(module, config, list(todo.values()), space, workers=compile_workers, num_kv_heads=num_kv_heads,
                   device=device, progress=progress, launches_of=launches_of)
    failed = []
    for index, (key, (group_size, batch, context)) in enumerate(shapes.items(), 1):
        if key in done and not force:
            progress(f"[{index}/{total}] {key}: already tuned ({tuned_files.candidate_id(done[key]['best'])}), skipped")
            continue
        bucket = functools.partial(tune_bucket, module, config, group_size, batch, context, space, timer=timer,
                                   screen_timer=screen_timer, num_kv_heads=num_kv_heads, device=device)
        try:
            try:
                entry = bucket(launches=launches_of[(group_size, batch, context)])
            except TqgenError as exc:
                if key not in shortlisted:
                    raise
                # The new kernels reject every launch of the shortlist: the others may still run.
                progress(f"[{index}/{total}] {key}: every launch of the shortlist was rejected ({exc}); timing "
                         f"every candidate")
                del shortlisted[key]
                entry = bucket(launches=every_launch[(group_size, batch, context)])
        except TqgenError as exc:  # one bad bucket must not cost the others: report it, go on
            failed.append(key)
            progress(f"[{index}/{total}] {key}: FAILED, {exc}")
            continue
        if key in shortlisted:
            entry["shortlist"] = shortlisted[key]
        tuned_files.save_bucket(path, metadata, key, entry)
        of = f" of {shortlisted[key]['of']} (shortlist)" if key in shortlisted else ""
        progress(f"[{index}/{total}] {key}: best {tuned_files.candidate_id(entry['best'])} {entry['best_us']:.1f} us "
                 f"({len(entry['timings_us'])} timed{of}, {len(entry['rejected'])} rejected, {entry['seconds']:.0f} s)")
    if failed:
        saved = f"the others were saved to {path}" if len(failed) < total else "nothing new was saved"
        raise TqgenError(f"{config.name}: {len(failed)} of {total} buckets have no valid candidate "
                         f"({', '.join(failed)}); they keep their earlier entry, if any, else the heuristic "
                         f"launch; {saved}")
    return path
