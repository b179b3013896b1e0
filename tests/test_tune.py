"""Tuning machinery on the CPU: buckets, the tuned file, resume, locking, baking.

The tuner runs the real kernels under the interpreter with a wall-clock
timer; on the GPU `tqgen tune` uses CUDA-graph timings instead.
"""

import dataclasses
import errno
import json
import multiprocessing
import os
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
import triton

from conftest import INTERPRET, KernelRecorder, check_decode, make_config
import fit_split_rule  # tools/ (pyproject.toml: pythonpath)
from tqgen import config as config_mod, emit, render, tuned_files, tuner
from tqgen.buckets import bucket_batch, bucket_bounds, bucket_key, default_buckets
from tqgen.errors import TqgenError
from tqgen.plan import Plan

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CPU tuning runs under the interpreter")

REPO = Path(__file__).resolve().parent.parent
FINGERPRINT = {"device_name": "Test GPU", "compute_capability": "9.0", "sm_count": 4,
               "triton_version": triton.__version__, "torch_version": torch.__version__.split("+")[0]}
# Stage 2 alone merges the splits: these tests' tunes take half as long on the interpreter, and
# test_a_small_batch_bucket_times_both_merges_and_bakes_the_choice times the other way.
SPACE = tuner.SearchSpace(block_kv=(32, 64), num_warps=(1,), num_stages=(1,), num_splits=(1, 2),
                          merge_in_stage1=(False,), heuristic=False)
BUCKETS = [(2, 2, 200), (2, 1, 100)]  # -> g2_b2_t256 and g2_b1_t256


def candidates(module, batch):
    """SPACE's candidates as the tuner times them at this batch."""
    return tuner.bucket_candidates(module, SPACE, batch)


def cpu_timer(fn):
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    config = make_config("k3v4", head_dim=64)
    module = emit.load(config, tmp_path_factory.mktemp("modules"))
    return config, module


def run_tune(setup, root, buckets=BUCKETS, timer=cpu_timer, progress=None, space=SPACE, **kwargs):
    config, module = setup
    lines = []
    path = tuner.tune(config, module, buckets, space, root=root, fingerprint=FINGERPRINT,
                     timer=timer, num_kv_heads=1, device="cpu",
                     progress=progress or lines.append, **kwargs)
    return path, lines


def test_bucket_keys_round_up_to_powers_of_two():
    assert bucket_key(4, 17, 4097) == bucket_key(4, 32, 8192) == "g4_b32_t8192"
    assert bucket_key(4, 33, 8192) == "g4_b64_t8192"
    assert bucket_key(6, 1, 1) == "g6_b1_t256"  # contexts below 256 share one bucket
    assert bucket_bounds("g4_b32_t8192") == {"group_size": 4, "batch": [17, 32], "context": [4097, 8192]}
    assert len(default_buckets()) == 4 * 28 and (4, 64, 16384) in default_buckets() and (4, 2, 1024) in default_buckets()
    assert {group for group, _, _ in default_buckets()} == {1, 4, 8, 16}


def test_tune_writes_metadata_and_every_candidate(setup, tmp_path):
    config, module = setup
    path, lines = run_tune(setup, tmp_path)
    assert path == tmp_path / "Test_GPU" / f"{config.artifact_name()}.json"
    document = json.loads(path.read_text())
    metadata = document["metadata"]
    assert metadata["config_hash"] == config.hash() and metadata["template_hash"] == render.template_hash()
    assert metadata["kernel_hash"] == render.decode_kernel_hash(config) and metadata["schema_version"] == tuned_files.SCHEMA_VERSION == 3
    assert metadata["device_name"] == "Test GPU" and metadata["sm_count"] == 4 and metadata["date"]
    assert list(document["buckets"]) == ["g2_b1_t256", "g2_b2_t256"]
    for entry in document["buckets"].values():
        expected = {tuned_files.candidate_id(c) for c in candidates(module, 2)}
        assert set(entry["timings_us"]) | set(entry["rejected"]) == expected
        assert not entry["rejected"]
        best = tuned_files.candidate_id(entry["best"])
        assert entry["timings_us"][best] == min(entry["timings_us"].values()) == entry["best_us"]
    assert len(lines) == 2 and all("best" in line for line in lines)


def test_rerun_skips_finished_buckets_and_leaves_the_file(setup, tmp_path):
    path, _ = run_tune(setup, tmp_path)
    before = path.read_bytes()
    _, lines = run_tune(setup, tmp_path, timer=lambda fn: pytest.fail("a finished bucket was timed again"))
    assert all("already tuned" in line for line in lines) and path.read_bytes() == before


def test_tuning_refuses_serial_launches_that_serving_would_not_use(setup, tmp_path, monkeypatch):
    """Batch-1 buckets are timed with dependent launches (Hopper+); a table timed without them
    would be baked for calls that use them."""
    _, module = setup
    monkeypatch.setattr(module, "DEPENDENT_LAUNCH", False)
    with pytest.raises(TqgenError, match="TQGEN_DEPENDENT_LAUNCH"):
        run_tune(setup, tmp_path)
    assert not list(tmp_path.iterdir())


def test_a_killed_run_keeps_the_buckets_it_finished(setup, tmp_path):
    calls = {"n": 0}

    def dying_timer(fn):
        calls["n"] += 1
        if calls["n"] > len(candidates(setup[1], 2)):  # the first bucket finished, the second dies
            raise KeyboardInterrupt
        return cpu_timer(fn)

    with pytest.raises(KeyboardInterrupt):
        run_tune(setup, tmp_path, timer=dying_timer)
    config, _ = setup
    path = tuned_files.tuned_path(tmp_path, "Test GPU", config)
    assert list(json.loads(path.read_text())["buckets"]) == ["g2_b2_t256"]
    _, lines = run_tune(setup, tmp_path)
    assert "already tuned" in lines[0] and "best" in lines[1]
    assert list(json.loads(path.read_text())["buckets"]) == ["g2_b1_t256", "g2_b2_t256"]


@pytest.mark.parametrize("damage,phrase", [
    (lambda doc: doc["metadata"].update(device_name="Other GPU"), "tuned for another setup (device_name"),
    (lambda doc: doc["metadata"].update(kernel_hash="0" * 64), "kernel_hash"),
    (lambda doc: doc["metadata"].update(schema_version=1), "schema_version"),
    (None, "corrupt or truncated JSON"),
])
def test_unusable_files_are_reported_ignored_and_never_overwritten(setup, tmp_path, damage, phrase, capsys):
    config, _ = setup
    path, _ = run_tune(setup, tmp_path, buckets=BUCKETS[:1])
    if damage is None:
        path.write_bytes(path.read_bytes()[:-40])  # truncated
    else:
        document = json.loads(path.read_text())
        damage(document)
        # the device name lives in the path too; keep the file where the tuner looks
        path.write_text(json.dumps(document))
    before = path.read_bytes()
    with pytest.raises(TqgenError, match=re.escape(phrase)) as error:
        run_tune(setup, tmp_path)
    assert str(path) in str(error.value) and path.read_bytes() == before
    module_text = emit.build(config, tmp_path / "out", tmp_path).read_text()
    if "device_name" in phrase:
        # Valid for the device it names: a build (which may run anywhere) bakes it under that name.
        assert "'Other GPU': {" in module_text
    else:
        # Other kernels or a damaged file: reported with its path, nothing baked.
        assert "TUNED_LAUNCHES = {}" in module_text
        assert str(path) in capsys.readouterr().err


def test_force_keeps_an_unusable_file_beside_the_new_one(setup, tmp_path):
    """--force re-tunes over a file of another kernel (the usual case after a kernel edit), and
    the old file stays, renamed to a name no reader looks for."""
    config, _ = setup
    path, _ = run_tune(setup, tmp_path, buckets=BUCKETS[:1])
    document = json.loads(path.read_text())
    document["metadata"]["kernel_hash"] = "0" * 64
    path.write_text(json.dumps(document))
    before = path.read_bytes()
    _, lines = run_tune(setup, tmp_path, force=True)
    kept = [p for p in path.parent.iterdir() if p != path]
    assert len(kept) == 1 and kept[0].name.startswith(path.name + ".replaced-") and kept[0].read_bytes() == before
    assert "kept as " + kept[0].name in lines[0] and "kernel_hash" in lines[0]
    fresh = json.loads(path.read_text())
    assert fresh["metadata"]["kernel_hash"] == render.decode_kernel_hash(config)
    assert list(fresh["buckets"]) == ["g2_b1_t256", "g2_b2_t256"]
    warnings = []
    baked = tuned_files.baked_launches(tmp_path, config, warnings.append)  # the new file, not the kept one
    assert not warnings and set(baked["Test GPU"]["buckets"]) == {"g2_b1_t256", "g2_b2_t256"}


def test_a_copy_of_a_device_folder_is_not_baked_over_the_tuners_own(setup, tmp_path):
    """Two files for one device (a backup copy of its folder beside it): a build bakes the one in the folder the
    tuner writes (tuned_path), whatever the copy's name sorts as, and says which it left out."""
    config, _ = setup
    path, _ = run_tune(setup, tmp_path)
    for backup in ("Test_GPU_old", "A_backup"):
        copy = tmp_path / backup / path.name
        copy.parent.mkdir()
        document = json.loads(path.read_text())
        del document["buckets"]["g2_b1_t256"]  # an older tune: one bucket fewer
        copy.write_text(json.dumps(document))
    warnings = []
    baked = tuned_files.baked_launches(tmp_path, config, warnings.append)
    assert set(baked["Test GPU"]["buckets"]) == {"g2_b1_t256", "g2_b2_t256"}
    assert baked["Test GPU"]["source"].startswith(f"Test_GPU/{path.name}")
    assert len(warnings) == 2 and all("Test_GPU/" in line and "Test GPU" in line for line in warnings)
    assert any("Test_GPU_old" in line for line in warnings) and any("A_backup" in line for line in warnings)
    # Without the tuner's own folder, the first in name order is baked and the other reported.
    shutil.rmtree(path.parent)
    warnings.clear()
    baked = tuned_files.baked_launches(tmp_path, config, warnings.append)
    assert baked["Test GPU"]["source"].startswith("A_backup/") and len(warnings) == 1 and "Test_GPU_old" in warnings[0]


def test_setting_aside_checks_the_file_again_under_the_lock(setup, tmp_path):
    """Another tuner may have replaced the unusable file (or set it aside) between this tuner's
    first read and its lock: then nothing is renamed and its buckets are kept."""
    config, _ = setup
    path, _ = run_tune(setup, tmp_path, buckets=BUCKETS[:1])
    metadata = tuned_files.make_metadata(config, FINGERPRINT)
    before = path.read_bytes()
    assert tuned_files.set_aside_unusable(path, metadata) == (None, json.loads(before)["buckets"])
    assert path.read_bytes() == before and [p.name for p in path.parent.iterdir()] == [path.name]
    path.unlink()
    assert tuned_files.set_aside_unusable(path, metadata) == (None, {})


def test_a_wrong_candidate_is_rejected_not_picked(setup, tmp_path, monkeypatch):
    config, module = setup
    original = module.decode

    def broken_for_two_splits(*args, **kwargs):
        out = original(*args, **kwargs)
        return out + 1.0 if kwargs.get("num_splits") == 2 else out

    monkeypatch.setattr(module, "decode", broken_for_two_splits)
    path, _ = run_tune(setup, tmp_path, buckets=BUCKETS[:1])
    entry = json.loads(path.read_text())["buckets"]["g2_b2_t256"]
    assert set(entry["rejected"]) == {"kv32_w1_st1_sp2", "kv64_w1_st1_sp2"}
    assert all("relative error" in reason for reason in entry["rejected"].values())
    assert entry["best"]["num_splits"] == 1


def test_each_bucket_is_checked_on_the_same_seeded_data_without_touching_the_global_rng(setup, monkeypatch):
    config, module = setup
    seen = []
    original = module.decode

    def recording(query, cache, *args, **kwargs):
        seen.append((query.clone(), cache.clone()))
        return original(query, cache, *args, **kwargs)

    monkeypatch.setattr(module, "decode", recording)
    one_launch = tuner.SearchSpace(block_kv=(32,), num_warps=(1,), num_stages=(1,), num_splits=(1,),
                                   merge_in_stage1=(False,))
    torch.manual_seed(123)
    state = torch.get_rng_state()
    for _ in range(2):
        tuner.tune_bucket(module, config, 2, 1, 100, one_launch, timer=cpu_timer, num_kv_heads=1, device="cpu")
    assert torch.equal(torch.get_rng_state(), state)
    assert len(seen) == 6  # per run: the check, the warm-up and the timed call on the full problem
    for (query, cache), (query_again, cache_again) in zip(seen[:3], seen[3:]):
        assert torch.equal(query, query_again) and torch.equal(cache, cache_again)


def _save_many(path, metadata, worker):
    for i in range(15):
        tuned_files.save_bucket(path, metadata, f"g{worker}_b{i + 1}_t256",
                          {"best": {"block_kv": 32, "num_warps": 1, "num_stages": 1, "num_splits": worker}})


def test_concurrent_tuners_keep_each_others_buckets(setup, tmp_path):
    config, _ = setup
    metadata = tuned_files.make_metadata(config, FINGERPRINT)
    path = tuned_files.tuned_path(tmp_path, "Test GPU", config)
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_save_many, args=(path, metadata, w)) for w in (1, 2, 3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
        assert worker.exitcode == 0
    buckets = tuned_files.read(path, metadata)
    assert len(buckets) == 45 and {b["best"]["num_splits"] for b in buckets.values()} == {1, 2, 3}
    # Neither temporary files nor lock files stay behind (a wheel packs all of tuned/).
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def _tune_in_process(root, module_dir, buckets):
    config = make_config("k3v4", head_dim=64)
    # Progress goes to this process's stdout, so a failure shows which candidate failed and why.
    run_tune((config, emit.load(config, module_dir)), root, buckets=buckets, progress=print)


def test_two_tuner_processes_on_one_config_both_finish(tmp_path):
    """Two real tuner processes on the same config and file, overlapping buckets: both exit 0 and
    the file ends up with every bucket either of them tuned, each a complete entry."""
    context = multiprocessing.get_context("spawn")
    plans = [[(2, 2, 200), (2, 1, 100)], [(2, 1, 100), (2, 4, 300)]]
    workers = [context.Process(target=_tune_in_process, args=(tmp_path / "tuned", tmp_path / f"m{i}", plan))
               for i, plan in enumerate(plans)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=600)
        assert worker.exitcode == 0
    config = make_config("k3v4", head_dim=64)
    metadata = tuned_files.make_metadata(config, FINGERPRINT)
    buckets = tuned_files.read(tuned_files.tuned_path(tmp_path / "tuned", "Test GPU", config), metadata)
    assert sorted(buckets) == ["g2_b1_t256", "g2_b2_t256", "g2_b4_t512"]
    assert all(len(entry["timings_us"]) == len(SPACE.candidates()) for entry in buckets.values())


def test_build_bakes_tuned_launches_and_decode_uses_them(setup, tmp_path, monkeypatch):
    config, _ = setup
    path, _ = run_tune(setup, tmp_path)
    entry = json.loads(path.read_text())["buckets"]["g2_b2_t256"]
    module = emit.load(config, tmp_path / "out", tmp_path)
    baked = module.TUNED_LAUNCHES["Test GPU"]
    assert baked["triton_version"] == triton.__version__ and "Test_GPU/" in baked["source"]
    assert baked["buckets"]["g2_b2_t256"] == tuple(entry["best"][f] for f in tuned_files.LAUNCH_FIELDS)
    assert "Test GPU: 2 buckets" in module.__doc__

    assert baked["kv_heads"] == 1  # run_tune's --kv-heads, which the module counts a call's pairs over

    monkeypatch.setattr(module.torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    assert module._tuned_buckets("cuda") == (1, baked["buckets"])
    monkeypatch.setitem(baked, "triton_version", "0.0.0")
    with pytest.warns(UserWarning, match="tuned with triton 0.0.0"):
        assert module._tuned_buckets("cuda") == (None, {})
    monkeypatch.setattr(module.torch.cuda, "get_device_name", lambda device=None: "Another GPU")
    assert module._tuned_buckets("cuda") == (None, {})


def test_each_bucket_also_times_the_heuristics_launch(setup, tmp_path):
    """Beside the space's launches the tuner times the one an untuned bucket of the shape runs
    (decode_launch_defaults), once, so a tuned bucket is never slower than none by the tuner's own clock; the
    bucket's workspace holds that launch's splits where the space's are fewer."""
    config, module = setup
    space = tuner.SearchSpace(block_kv=(32,), num_warps=(1,), num_stages=(1,), num_splits=(1,),
                              merge_in_stage1=(False,))
    heuristic = dict(zip(tuned_files.LAUNCH_FIELDS, module.decode_launch_defaults(1, 1, 2, 256, "cpu")))
    assert heuristic["num_splits"] > 1  # more than the space's
    path = tuner.tune(config, module, [(2, 1, 100)], space, root=tmp_path, fingerprint=FINGERPRINT, timer=cpu_timer,
                      num_kv_heads=1, device="cpu", progress=lambda line: None)
    entry = json.loads(path.read_text())["buckets"]["g2_b1_t256"]
    assert set(entry["timings_us"]) == {"kv32_w1_st1_sp1", tuned_files.candidate_id(heuristic)}
    assert not entry["rejected"]
    shape = (2, 1, 256)
    within = dataclasses.replace(space, num_splits=(1, heuristic["num_splits"]))
    launches_of = tuner._bucket_launches(module, within, {"g2_b1_t256": shape}, 1, "cpu")
    assert len(launches_of[shape]) == 2  # already in the space: timed once
    launches_of = tuner._bucket_launches(module, dataclasses.replace(space, heuristic=False), {"g2_b1_t256": shape},
                                         1, "cpu")
    assert launches_of[shape] == space.candidates()


def test_bucket_batch_counts_sequence_kv_head_pairs_over_the_timed_kv_heads():
    assert bucket_batch(32, 32, 8) == 128  # MHA's 32 KV heads: the grid of 128 sequences of 8
    assert bucket_batch(32, 1, 8) == 4  # one KV head a GPU (tensor parallel): the grid of 4 sequences of 8
    assert bucket_batch(5, 4, 8) == 3  # rounded up
    assert bucket_batch(3, 8, 8) == 3  # the timed KV heads: the call's own batch
    assert bucket_batch(1, 1, 8) == bucket_batch(0, 8, 8) == 1  # below one timed sequence: the smallest batch


def test_a_tuned_launch_is_read_from_the_bucket_of_as_many_kv_head_pairs(tmp_path, monkeypatch):
    """Launches timed over 8 KV heads serve a call of other KV heads from the bucket whose timed problem had as
    many (sequence, KV head) pairs, so the same grid: 32 sequences of 32 KV heads read the 128-sequence bucket,
    32 of 2 the 8-sequence one, for the launch, the query's rotation and the split merge alike; called without
    num_kv_heads, merged_in_stage1 and query_rotated_in_stage1 count sequences of 8 KV heads."""
    module = emit.load(make_config("k3v4", cache_layout="planes"), tmp_path)
    tuned = {"triton_version": triton.__version__, "source": "", "kv_heads": 8, "buckets": {
        "g4_b8_t8192": (32, 1, 1, 16, False, True), "g4_b32_t8192": (64, 1, 2, 8, None),
        "g4_b128_t8192": (32, 1, 2, 4, None)}}
    monkeypatch.setattr(module, "TUNED_LAUNCHES", {"Test GPU": tuned})
    monkeypatch.setattr(module, "_per_device", {})  # nothing cached from other tests
    monkeypatch.setattr(module.torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    gpu = torch.device("cuda", 0)
    assert module.decode_launch(32, 8, 4, 8192, gpu) == (64, 1, 2, 8)
    assert module.decode_launch(32, 32, 4, 8192, gpu) == (32, 1, 2, 4)
    assert module.decode_launch(32, 2, 4, 8192, gpu) == (32, 1, 1, 16)
    assert module._tuned_launch(gpu, 4, 8, 8192, 2) is None  # 16 pairs: the 2-sequence bucket, not tuned
    assert module.merged_in_stage1(32, 4, 8192, gpu, 2) is True and module.merged_in_stage1(32, 4, 8192, gpu) is False
    assert module.query_rotated_in_stage1(32, 4, 8192, gpu, num_kv_heads=2) is False  # the 8-sequence bucket's
    # A table without the count (an engine's own) reads the call's batch as it is.
    del tuned["kv_heads"]
    module._per_device.clear()  # the cached table
    assert module.decode_launch(32, 32, 4, 8192, gpu) == (64, 1, 2, 8)


def test_a_tuned_file_holds_buckets_timed_over_one_kv_head_count(setup, tmp_path):
    """A module counts a call's pairs over one KV head count a file: a file whose buckets mix counts is unusable,
    a tune of another --kv-heads into it is refused before any timing, and so is a bucket saved into it."""
    config, module = setup
    path, _ = run_tune(setup, tmp_path, buckets=[(2, 1, 100)])  # timed over 1 KV head
    with pytest.raises(TqgenError, match=r"holds buckets timed over 1 KV heads; --kv-heads 8 would mix"):
        tuner.tune(config, module, [(2, 2, 100)], SPACE, root=tmp_path, fingerprint=FINGERPRINT, timer=cpu_timer,
                   num_kv_heads=8, device="cpu", progress=lambda line: None)
    document = json.loads(path.read_text())
    entry = json.loads(json.dumps(document["buckets"]["g2_b1_t256"]))
    entry["shape"]["num_kv_heads"] = 8
    with pytest.raises(TqgenError, match="timed over 8 KV heads to .*, whose buckets were timed over 1"):
        tuned_files.save_bucket(path, document["metadata"], "g2_b2_t256", entry)
    assert sorted(json.loads(path.read_text())["buckets"]) == ["g2_b1_t256"]  # nothing lost
    document["buckets"]["g2_b2_t256"] = entry
    path.write_text(json.dumps(document))
    with pytest.raises(tuned_files.Unusable, match=r"timed over different KV head counts \(\[1, 8\]\)"):
        tuned_files.read(path, document["metadata"])


def test_a_rotating_config_times_both_ways_up_to_the_batch_rule_and_bakes_the_choice(tmp_path, monkeypatch):
    """Where stage 1 can rotate the query (planes, MSE keys, the Hadamard rotation, head_dim 128), each bucket
    up to _ROTATE_QUERY_MAX_BATCH sequences times every launch with rotate_query True and False (ids _rq, _pq);
    the best's choice is baked as the launch's fifth field: query_rotated_in_stage1 (decode's choice when
    rotate_query is not passed) follows it, decode_launch keeps to the four launch fields."""
    config = make_config("k3v4", cache_layout="planes")
    module = emit.load(config, tmp_path / "modules")
    limit = module._ROTATE_QUERY_MAX_BATCH
    assert tuner.rotations(module, limit) == (True, False) and tuner.rotations(module, limit + 1) == (None,)
    space = tuner.SearchSpace(block_kv=(32,), num_warps=(1,), num_stages=(1,), num_splits=(1, 2),
                              merge_in_stage1=(False,), heuristic=False)
    path = tuner.tune(config, module, [(4, 1, 100)], space, root=tmp_path, fingerprint=FINGERPRINT, timer=cpu_timer,
                      num_kv_heads=1, device="cpu", progress=lambda line: None)
    document = json.loads(path.read_text())
    entry = document["buckets"]["g4_b1_t256"]
    assert set(entry["timings_us"]) == {f"kv32_w1_st1_sp{s}_{q}" for s in (1, 2) for q in ("rq", "pq")}
    assert not entry["rejected"] and isinstance(entry["best"]["rotate_query"], bool)

    entry["best"] = dict(block_kv=32, num_warps=1, num_stages=1, num_splits=2, rotate_query=False)  # against the rule
    path.write_text(json.dumps(document))
    baked_module = emit.load(config, tmp_path / "out", tmp_path)
    assert baked_module.TUNED_LAUNCHES["Test GPU"]["buckets"]["g4_b1_t256"] == (32, 1, 1, 2, False)
    monkeypatch.setattr(baked_module.torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    gpu = torch.device("cuda", 0)
    assert baked_module.decode_launch(1, 1, 4, 256, gpu) == (32, 1, 1, 2)
    assert baked_module.query_rotated_in_stage1(1, 4, 256, gpu) is False  # the tuned bucket's choice
    assert baked_module.query_rotated_in_stage1(2, 4, 256, gpu) is True  # untuned: the batch rule
    assert baked_module.query_rotated_in_stage1(1, 4, 256, gpu, tuned=False) is True  # the heuristic's choice


def test_the_search_space_can_time_stage_1s_rotation_alone_and_merges_only_up_to_some_splits(tmp_path):
    """SearchSpace.rotate_query (True,) times each launch with the query rotated in stage 1 only (ids _rq, the
    choice still recorded); merge_max_splits N times stage 1 merging its splits only for launches of at most N
    splits, stage 2 for every launch; neither touches a bucket above the batch rules, where decode has no choice."""
    module = emit.load(make_config("k3v4", cache_layout="planes"), tmp_path / "modules")
    space = tuner.SearchSpace(block_kv=(32,), num_warps=(1,), num_stages=(1,), num_splits=(1, 2, 4),
                              rotate_query=(True,), merge_max_splits=2)
    small = [tuned_files.candidate_id(launch) for launch in tuner.bucket_candidates(module, space, 1)]
    assert sorted(small) == sorted([f"kv32_w1_st1_sp{s}_rq" for s in (1, 2, 4)]
                                   + [f"kv32_w1_st1_sp{s}_rq_ms" for s in (1, 2)])
    both = tuner.SearchSpace(block_kv=(32,), num_warps=(1,), num_stages=(1,), num_splits=(1, 2, 4))
    assert len(tuner.bucket_candidates(module, both, 1)) == 3 * 2 * 2  # every rotation and merge, every launch
    large = max(module._ROTATE_QUERY_MAX_BATCH, module._MERGE_IN_STAGE1_MAX_BATCH) + 1
    assert [tuned_files.candidate_id(launch) for launch in tuner.bucket_candidates(module, space, large)] == [
        f"kv32_w1_st1_sp{s}" for s in (1, 2, 4)]


def test_a_shortlist_keeps_the_fastest_earlier_launches_and_those_never_timed():
    """A shortlisted bucket times the `size` launches fastest in the earlier tune's entry (fastest first; launches
    of that entry no longer in the space are passed over), then those the entry neither timed nor rejected (new to
    the space); an entry that timed none of the launches gives them all back."""
    names = ["kv32_w1_st1_sp1", "kv32_w1_st1_sp2", "kv32_w1_st1_sp4", "kv64_w1_st1_sp1", "kv64_w1_st1_sp2"]
    launches = [dict(zip(tuned_files.LAUNCH_FIELDS, (int(n[2:4]), 1, 1, int(n.split("sp")[1])))) for n in names]
    assert [tuned_files.candidate_id(launch) for launch in launches] == names
    earlier = {"timings_us": {"kv32_w1_st1_sp4": 9.0, "kv64_w1_st1_sp1": 7.0, "kv32_w1_st2_sp8": 1.0,
                              "kv32_w1_st1_sp1": 12.0},
               "rejected": {"kv32_w1_st1_sp2": "RuntimeError: too much shared memory"}}
    picked = [tuned_files.candidate_id(launch) for launch in tuner.shortlist(launches, earlier, 2)]
    assert picked == ["kv64_w1_st1_sp1", "kv32_w1_st1_sp4", "kv64_w1_st1_sp2"]
    picked = [tuned_files.candidate_id(launch) for launch in tuner.shortlist(launches, earlier, 10)]
    assert picked == ["kv64_w1_st1_sp1", "kv32_w1_st1_sp4", "kv32_w1_st1_sp1", "kv64_w1_st1_sp2"]
    assert tuner.shortlist(launches, {"timings_us": {"kv32_w1_st2_sp8": 1.0}}, 2) == launches
    assert tuner.shortlist(launches, None, 2) == launches


def test_a_shortlist_counts_each_new_choice_of_an_earlier_launch_as_that_launch():
    """An earlier tune without the query-rotation or split-merge choice (ids without _rq/_pq or _ms): each choice of
    one of its `size` fastest launches is timed, of the others none; a split count it never timed is new."""
    space = tuner.SearchSpace(block_kv=(32,), num_warps=(1,), num_stages=(1,), num_splits=(4, 8, 16))
    launches = space.candidates((True, False), (False, True))
    earlier = {"timings_us": {"kv32_w1_st1_sp4": 9.0, "kv32_w1_st1_sp8": 7.0}}
    picked = [tuned_files.candidate_id(launch) for launch in tuner.shortlist(launches, earlier, 1)]
    assert picked == ["kv32_w1_st1_sp8_rq", "kv32_w1_st1_sp8_pq", "kv32_w1_st1_sp8_rq_ms", "kv32_w1_st1_sp8_pq_ms",
                      "kv32_w1_st1_sp16_rq", "kv32_w1_st1_sp16_pq", "kv32_w1_st1_sp16_rq_ms", "kv32_w1_st1_sp16_pq_ms"]
    # An earlier tune that had the rotation but not the merge: the rotation is matched by name.
    earlier = {"timings_us": {"kv32_w1_st1_sp4_pq": 5.0, "kv32_w1_st1_sp4_rq": 6.0, "kv32_w1_st1_sp8_rq": 7.0,
                              "kv32_w1_st1_sp8_pq": 8.0, "kv32_w1_st1_sp16_rq": 9.0, "kv32_w1_st1_sp16_pq": 9.5}}
    picked = [tuned_files.candidate_id(launch) for launch in tuner.shortlist(launches, earlier, 2)]
    assert picked == ["kv32_w1_st1_sp4_pq", "kv32_w1_st1_sp4_pq_ms", "kv32_w1_st1_sp4_rq", "kv32_w1_st1_sp4_rq_ms"]


def test_the_shortlist_replay_reads_candidate_ids_back_and_scores_a_missed_best(tmp_path):
    """tools/shortlist_regret.py (docs/tuning.md's case for --shortlist 12): every id the tuner writes reads back as
    its launch, and a re-tune whose best was not in the earlier tune's shortlist scores its loss."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("shortlist_regret", REPO / "tools" / "shortlist_regret.py")
    replay = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(replay)
    space = tuner.SearchSpace(num_warps=(1, 2))
    for launch in space.candidates((True, False), (False, True)) + space.candidates():
        name = tuned_files.candidate_id(launch)  # a merge by stage 2 has no suffix: it reads back as no field
        expected = {field: value for field, value in launch.items()
                    if not (field == tuned_files.MERGE_FIELD and value is False)}
        assert replay.launch_of(name) == expected and tuned_files.candidate_id(expected) == name
    earlier = {"g4_b1_t1024": {"timings_us": {"kv32_w1_st1_sp8": 5.0, "kv32_w1_st1_sp16": 6.0, "kv64_w1_st1_sp8": 7.0}},
               "g4_b2_t1024": {"timings_us": {"kv32_w1_st1_sp8": 5.0}}}
    later = {"g4_b1_t1024": {"timings_us": {"kv32_w1_st1_sp8": 10.0, "kv32_w1_st1_sp16": 9.0, "kv64_w1_st1_sp8": 8.0}},
             "g4_b2_t1024": {"timings_us": {"kv32_w1_st1_sp8": 5.0}}}  # carried over unchanged: not a re-tune
    assert replay.regrets(earlier, later, 2) == [(9.0 / 8.0, 2, 3)]  # its best, of 2 of 3 candidates timed
    assert replay.regrets(earlier, later, 3) == [(1.0, 3, 3)]


def _staled(path, edit=lambda buckets: None):
    """Make the tuned file at path look timed on another kernel (edit changes its buckets first); its bytes."""
    document = json.loads(path.read_text())
    document["metadata"]["kernel_hash"] = "0" * 64
    edit(document["buckets"])
    path.write_text(json.dumps(document))
    return path.read_bytes()


def test_a_shortlisted_retune_times_only_the_earlier_fastest_and_says_so(setup, tmp_path):
    """--force --shortlist 1 over a file of another kernel: a bucket it timed times only its fastest launch there
    and its entry names the shortlist; a bucket it lacks times every candidate; the old file is kept whole. With
    no earlier tune at all, every candidate is timed, and the tuner says why."""
    _, module = setup
    path, first = run_tune(setup, tmp_path, shortlist_size=1)
    assert "no earlier tune" in first[0] and "every candidate is timed" in first[0]
    assert not any("shortlist" in entry for entry in json.loads(path.read_text())["buckets"].values())
    ids = [tuned_files.candidate_id(launch) for launch in candidates(module, 2)]

    def edit(buckets):
        buckets["g2_b2_t256"]["timings_us"] = {name: 5.0 if name == ids[2] else 50.0 for name in ids}
        del buckets["g2_b1_t256"]

    before = _staled(path, edit)
    _, lines = run_tune(setup, tmp_path, force=True, shortlist_size=1)
    document = json.loads(path.read_text())
    shortlisted, full = document["buckets"]["g2_b2_t256"], document["buckets"]["g2_b1_t256"]
    assert list(shortlisted["timings_us"]) == [ids[2]] and tuned_files.candidate_id(shortlisted["best"]) == ids[2]
    assert shortlisted["shortlist"] == {"size": 1, "of": len(ids), "from_kernel_hash": "0" * 64}
    assert "shortlist" not in full and set(full["timings_us"]) == set(ids)
    assert any(f"1 timed of {len(ids)} (shortlist)" in line for line in lines), lines
    kept = [p for p in path.parent.iterdir() if p != path]
    assert len(kept) == 1 and kept[0].read_bytes() == before


def test_a_shortlist_the_new_kernels_reject_whole_falls_back_to_every_candidate(setup, tmp_path, monkeypatch):
    """If every launch of a bucket's shortlist fails on the new kernels (they no longer compile, say), the bucket
    times every candidate before it gives up: the others may run."""
    _, module = setup
    path, _ = run_tune(setup, tmp_path, buckets=BUCKETS[:1])
    ids = [tuned_files.candidate_id(launch) for launch in candidates(module, 2)]
    _staled(path, lambda buckets: buckets["g2_b2_t256"].update(timings_us={name: 1.0 if name == ids[0] else 50.0
                                                                             for name in ids}))
    original = module.decode

    def failing(*args, **kwargs):
        if tuned_files.candidate_id(kwargs) == ids[0]:
            raise RuntimeError("out of resources")
        return original(*args, **kwargs)

    monkeypatch.setattr(module, "decode", failing)
    _, lines = run_tune(setup, tmp_path, buckets=BUCKETS[:1], force=True, shortlist_size=1)
    entry = json.loads(path.read_text())["buckets"]["g2_b2_t256"]
    assert "every launch of the shortlist was rejected" in lines[1] and "best" in lines[2], lines
    assert set(entry["timings_us"]) == set(ids[1:]) and list(entry["rejected"]) == [ids[0]]
    assert "shortlist" not in entry
    # With the heuristic's launch among the candidates (and slow in the earlier tune), the fallback times it too.
    heuristic = tuned_files.candidate_id(dict(zip(tuned_files.LAUNCH_FIELDS,
                                                  module.decode_launch_defaults(2, 1, 2, 256, "cpu"))))
    assert heuristic not in ids
    _staled(path, lambda buckets: buckets["g2_b2_t256"].update(timings_us={name: 1.0 if name == ids[0] else 50.0
                                                                             for name in [*ids, heuristic]}))
    _, lines = run_tune(setup, tmp_path, buckets=BUCKETS[:1], force=True, shortlist_size=1,
                        space=dataclasses.replace(SPACE, heuristic=True))
    assert "every launch of the shortlist was rejected" in lines[1], lines
    entry = json.loads(path.read_text())["buckets"]["g2_b2_t256"]
    assert set(entry["timings_us"]) == set(ids[1:]) | {heuristic} and "shortlist" not in entry


def test_a_shortlisted_retune_resumes_from_the_file_it_set_aside(setup, tmp_path):
    """A shortlisted re-tune killed after its first bucket: the re-run (no --force: the new file is current) takes
    the rest's shortlists from the earlier file, which the first run kept as NAME.json.replaced-TIME."""
    _, module = setup
    path, _ = run_tune(setup, tmp_path)
    _staled(path)
    calls = {"n": 0}

    def dying_timer(fn):
        calls["n"] += 1
        if calls["n"] > 1:  # the first bucket's one shortlisted launch is timed, the second bucket dies
            raise KeyboardInterrupt
        return cpu_timer(fn)

    with pytest.raises(KeyboardInterrupt):
        run_tune(setup, tmp_path, force=True, shortlist_size=1, timer=dying_timer)
    assert list(json.loads(path.read_text())["buckets"]) == ["g2_b2_t256"]
    _, lines = run_tune(setup, tmp_path, shortlist_size=1)
    assert "already tuned" in lines[0] and "(shortlist)" in lines[1]
    resumed = json.loads(path.read_text())["buckets"]["g2_b1_t256"]
    assert len(resumed["timings_us"]) == 1 and resumed["shortlist"]["from_kernel_hash"] == "0" * 64


def test_a_shortlist_can_come_from_another_gpus_table_of_the_config(setup, tmp_path):
    """--shortlist-from: a bucket this GPU's file never timed takes its shortlist from another GPU's table of the
    config, and its entry names that GPU; one the file's own earlier tune timed keeps that tune's shortlist. A
    table of another config, or a file that is not a tuned file, is refused in one line before any timing."""
    _, module = setup
    table_path, _ = run_tune(setup, tmp_path / "other")
    table = json.loads(table_path.read_text())
    table["metadata"].update(device_name="Other GPU", kernel_hash="1" * 64)
    fastest = {}
    for key, entry in table["buckets"].items():
        ids = [tuned_files.candidate_id(launch) for launch in candidates(module, entry["shape"]["batch"])]
        fastest[key] = ids[-1]
        entry["timings_us"] = {name: 5.0 if name == ids[-1] else 50.0 for name in ids}
    source = tmp_path / "other.json"
    source.write_text(json.dumps(table))
    mine, _ = run_tune(setup, tmp_path / "mine", buckets=BUCKETS[:1])  # this GPU's own tune of g2_b2_t256
    own = tuned_files.candidate_id(candidates(module, 2)[0])  # not the other GPU's fastest there
    assert own != fastest["g2_b2_t256"]

    def own_fastest(buckets):
        timed = buckets["g2_b2_t256"]["timings_us"]
        buckets["g2_b2_t256"]["timings_us"] = {name: 1.0 if name == own else 2.0 for name in timed}

    _staled(mine, own_fastest)
    path, lines = run_tune(setup, tmp_path / "mine", force=True, shortlist_size=1, shortlist_from=source)
    buckets = json.loads(path.read_text())["buckets"]
    assert list(buckets["g2_b2_t256"]["timings_us"]) == [own]
    assert buckets["g2_b2_t256"]["shortlist"] == {"size": 1, "of": len(candidates(module, 2)),
                                                  "from_kernel_hash": "0" * 64}
    assert buckets["g2_b1_t256"]["shortlist"] == {"size": 1, "of": len(candidates(module, 1)),
                                                  "from_kernel_hash": "1" * 64, "from_device": "Other GPU"}
    assert list(buckets["g2_b1_t256"]["timings_us"]) == [fastest["g2_b1_t256"]]
    table["metadata"]["config_hash"] = "2" * 64
    source.write_text(json.dumps(table))
    with pytest.raises(TqgenError, match=r"--shortlist-from .*other.json: tuned for another config") as refused:
        run_tune(setup, tmp_path / "third", shortlist_size=1, shortlist_from=source)
    assert "\n" not in str(refused.value)
    source.write_text("[1, 2]")
    unreadable = r"--shortlist-from .*other.json: cannot be read \(not a tuned file"
    with pytest.raises(TqgenError, match=unreadable) as refused:
        run_tune(setup, tmp_path / "third", shortlist_size=1, shortlist_from=source)
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "third").exists() or not any((tmp_path / "third").rglob("*.json"))


def test_earlier_buckets_prefer_the_file_itself_and_skip_other_devices_and_damage(tmp_path):
    path = tmp_path / "Test_GPU" / "tq_x.json"
    path.parent.mkdir()

    def write(target, device, kernel, buckets):
        target.write_text(json.dumps({"metadata": {"device_name": device, "kernel_hash": kernel}, "buckets": buckets}))

    entry = lambda us: {"timings_us": {"kv32_w1_st1_sp4": us}}  # noqa: E731
    write(path.with_name(path.name + ".replaced-20261201T000000Z"), "Test GPU", "a", {"g4_b1_t1024": entry(1.0),
                                                                                       "g4_b2_t1024": entry(2.0)})
    write(path.with_name(path.name + ".replaced-20261202T000000Z"), "Test GPU", "b", {"g4_b1_t1024": entry(3.0),
                                                                                       "g4_b4_t1024": "damaged"})
    write(path.with_name(path.name + ".replaced-20261203T000000Z"), "Other GPU", "c", {"g4_b8_t1024": entry(4.0)})
    path.with_name(path.name + ".replaced-20261204T000000Z").write_text("{truncated")
    write(path, "Test GPU", "d", {"g4_b2_t1024": entry(5.0)})
    found = tuned_files.earlier_buckets(path, "Test GPU")
    assert {key: (entry["timings_us"]["kv32_w1_st1_sp4"], kernel) for key, (entry, kernel) in found.items()} == {
        "g4_b1_t1024": (3.0, "b"), "g4_b2_t1024": (5.0, "d")}
    assert tuned_files.earlier_buckets(tmp_path / "Test_GPU" / "tq_none.json", "Test GPU") == {}


def test_a_small_batch_bucket_times_both_merges_and_bakes_the_choice(setup, tmp_path, monkeypatch):
    """Up to _MERGE_IN_STAGE1_MAX_BATCH sequences each launch is timed with its splits merged by stage 2 and by
    stage 1 itself (ids _ms); the best's choice is baked as the launch's sixth field (after rotate_query, None
    where the config has no such choice): merged_in_stage1 (decode's choice when merge_in_stage1 is not passed)
    follows it, decode_launch keeps to the four launch fields, and larger batches time stage 2 only."""
    config, module = setup
    limit = module._MERGE_IN_STAGE1_MAX_BATCH
    assert tuner.merges(module, limit) == (False, True) and tuner.merges(module, limit + 1) == (None,)
    assert tuner.merges(module, 1, (False,)) == (None,)  # stage 2 alone: no field, decode's own choice
    space = tuner.SearchSpace(block_kv=(32,), num_warps=(1,), num_stages=(1,), num_splits=(1, 2), heuristic=False)
    path = tuner.tune(config, module, [(2, 1, 100), (2, limit + 1, 100)], space, root=tmp_path,
                      fingerprint=FINGERPRINT, timer=cpu_timer, num_kv_heads=1, device="cpu",
                      progress=lambda line: None)
    document = json.loads(path.read_text())
    entry = document["buckets"]["g2_b1_t256"]
    assert set(entry["timings_us"]) == {f"kv32_w1_st1_sp{s}{m}" for s in (1, 2) for m in ("", "_ms")}
    assert not entry["rejected"] and isinstance(entry["best"]["merge_in_stage1"], bool)
    large = document["buckets"][bucket_key(2, limit + 1, 100)]
    assert set(large["timings_us"]) == {"kv32_w1_st1_sp1", "kv32_w1_st1_sp2"} and "merge_in_stage1" not in large["best"]

    entry["best"] = dict(block_kv=32, num_warps=1, num_stages=1, num_splits=2, merge_in_stage1=True)
    path.write_text(json.dumps(document))
    baked_module = emit.load(config, tmp_path / "out", tmp_path)
    assert baked_module.TUNED_LAUNCHES["Test GPU"]["buckets"]["g2_b1_t256"] == (32, 1, 1, 2, None, True)
    monkeypatch.setattr(baked_module.torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    gpu = torch.device("cuda", 0)
    assert baked_module.decode_launch(1, 1, 2, 256, gpu) == (32, 1, 1, 2)
    assert baked_module.merged_in_stage1(1, 2, 256, gpu) is True  # the tuned bucket's choice
    assert baked_module.merged_in_stage1(2, 2, 256, gpu) is False  # untuned: stage 2
    assert baked_module.merged_in_stage1(1, 2, 256, torch.device("cpu")) is False  # no tuned launches off CUDA


def test_decode_follows_query_rotated_in_stage1_where_rotate_query_is_not_passed(monkeypatch, tmp_path):
    config = make_config("k3v4", cache_layout="planes")
    module = emit.load(config, tmp_path)
    monkeypatch.setattr(module, "query_rotated_in_stage1", lambda batch, group_size, context, device, **_: False)
    prepare = KernelRecorder(module.tq_prepare_query)
    monkeypatch.setattr(module, "tq_prepare_query", prepare)
    check_decode(module, config, "cpu", [5])
    assert len(prepare.launches) == 1  # at batch 1, where the batch rule alone rotates in stage 1


def test_heuristic_uses_sm_count_batch_heads_and_context(setup):
    _, module = setup
    launch = module.heuristic_launch
    assert launch(1, 8, 4096, 132) == (64, 2, 1, 64)  # 8 programs: as many splits as allowed
    assert launch(1, 8, 1024, 132) == (64, 2, 1, 16)  # at most one split per 64 tokens
    assert launch(8, 8, 4096, 132) == (32, 1, 1, 16)  # 64 programs >= 132 / 4: one warp
    assert launch(32, 8, 4096, 132) == (32, 1, 1, 4)  # at least 4
    assert launch(32, 8, 65536, 132) == (32, 1, 1, 16)  # one split per 4096 tokens
    assert launch(32, 8, 65536, 2000) == (64, 2, 1, 32)  # more SMs: more splits, and 2 warps
    assert launch(1, 1, 100, 132) == (64, 2, 1, 2)


def test_launch_choice_takes_a_device_string_like_the_rest_of_the_api(monkeypatch, tmp_path):
    """decode_launch, decode_launch_defaults, decode_multi_launch, merged_in_stage1 and query_rotated_in_stage1 take
    a device as a string ("cpu", "cuda:1"), as DecodeWorkspace, make_cache and the dispatcher's variant_for do, and
    answer as for its torch.device (a string raised AttributeError: 'str' object has no attribute 'type')."""
    module = emit.load(make_config("k3v4", cache_layout="planes"), tmp_path)
    monkeypatch.setattr(module, "_per_device", {})  # nothing cached from other tests
    cpu = torch.device("cpu")
    for batch, group, context in [(1, 4, 4096), (3, 1, 100), (32, 8, 70000), (2, 16, 1)]:
        assert module.decode_launch(batch, 8, group, context, "cpu") == module.decode_launch(batch, 8, group, context,
                                                                                             cpu)
        assert module.decode_launch_defaults(batch, 8, group, context, "cpu") == module.decode_launch_defaults(
            batch, 8, group, context, cpu)
        assert module.decode_multi_launch(batch, 8, group, 2, context, "cpu") == module.decode_multi_launch(
            batch, 8, group, 2, context, cpu)
        assert module.merged_in_stage1(batch, group, context, "cpu") is False
        assert module.query_rotated_in_stage1(batch, group, context, "cpu") == module.query_rotated_in_stage1(
            batch, group, context, cpu)
    # A tuned bucket, on a GPU named by a string.
    tuned = {"triton_version": triton.__version__, "source": "", "buckets": {"g4_b1_t256": (64, 1, 2, 2, False, True)}}
    monkeypatch.setattr(module, "TUNED_LAUNCHES", {"Test GPU": tuned})
    monkeypatch.setattr(module.torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    assert module.decode_launch(1, 8, 4, 256, "cuda:1") == (64, 1, 2, 2)
    assert module.merged_in_stage1(1, 4, 256, "cuda:1") is True
    assert module.query_rotated_in_stage1(1, 4, 256, "cuda:1") is False


# The H200 timing tables the heuristic rules were fitted to: the committed files, and those of formats whose decode
# kernels changed since, re-tuned on an H100 (docs/tuning-tables/README.md).
H200_TABLES = fit_split_rule.table_folders("NVIDIA_H200")


def _h200_table_paths():
    """Each config's H200 table: the file in tuned/ where there is one, else its copy in docs/tuning-tables/."""
    paths = {}
    for folder in H200_TABLES:  # tuned/ first
        for path in sorted(folder.glob("tq_*.json")):
            paths.setdefault(path.name, path)
    return paths


def _h200_table(config):
    """The H200 timing table of an sm90 config (_h200_table_paths)."""
    return json.loads(_h200_table_paths()[f"{config.artifact_name()}.json"].read_text())


def _timing_tables(planes):
    """(file stem, bucket bounds, entry) of every H200 bucket of one cache layout (H200_TABLES)."""
    for path in sorted(_h200_table_paths().values(), key=lambda path: path.name):
        if ("_planes_" in path.stem) != planes:
            continue
        document = json.loads(path.read_text())
        for key, entry in document["buckets"].items():
            yield path.stem, bucket_bounds(key), entry


def _heuristic_ratios(module, tables, rule=None, rotate_query=None):
    """Each table's time of the launch `rule` (default: the module's heuristic_launch) picks for its bucket,
    over the bucket's best."""
    ratios = _ratios_by_bucket(module, tables, rule, rotate_query)
    unmeasured = [f"{name} {bounds}" for (name, bounds, _), ratio in zip(tables, ratios) if ratio is None]
    assert not unmeasured, f"{unmeasured}: the rule's launch was not measured"
    return ratios


def _ratios_by_bucket(module, tables, rule=None, rotate_query=None):
    """Per table entry, the time of the launch `rule` picks over the bucket's best (None where that launch was not
    timed), the query rotated as query_rotated_in_stage1 decides for an untuned call on this machine (no GPU: the
    tl.dot kernel's rule), or as `rotate_query` says."""
    rule = rule or module.heuristic_launch
    ratios = []
    for name, bounds, entry in tables:
        launch = rule(bounds["batch"][1], 8, bounds["context"][1], 132)
        launch = dict(zip(tuned_files.LAUNCH_FIELDS, launch))
        if rotate_query is not None:
            launch[tuned_files.ROTATE_FIELD] = rotate_query
        elif any(name.endswith(("_rq", "_pq")) for name in entry["timings_us"]):  # timed both ways: the batch rule's
            launch[tuned_files.ROTATE_FIELD] = module.query_rotated_in_stage1(
                bounds["batch"][1], bounds["group_size"], bounds["context"][1], torch.device("cuda", 0), tuned=False)
        candidate = tuned_files.candidate_id(launch)
        time = entry["timings_us"].get(candidate)
        ratios.append(None if time is None else time / entry["best_us"])
    return ratios


def _geomean(ratios):
    import math

    return math.exp(sum(map(math.log, ratios)) / len(ratios))


def test_heuristic_is_close_to_the_measured_best_on_the_h200(setup, tmp_path):
    """The heuristic's pick, looked up in the H200 timing tables (H200_TABLES) (every candidate of every
    bucket of every shipped "slots" config), against each bucket's best: the numbers README.md quotes.
    Each table is read with a module of its key format: fp8 keys as tuned, on sm90's Gluon kernel."""
    _, mse_module = setup  # head_dim 64: the tl.dot kernel's rule
    fp8_module = emit.load(make_config("k8v4", arch="sm90"), tmp_path)
    gluon_mse_module = emit.load(make_config("k3v4"), tmp_path)  # head_dim 128, 4-bit values: the Gluon kernel's
    assert gluon_mse_module.heuristic_launch(32, 8, 16384, 132) != mse_module.heuristic_launch(32, 8, 16384, 132)
    tables = list(_timing_tables(planes=False))
    # The Gluon kernel's (one rule at every head dim it takes: the d64 and d256 files too); the tl.dot kernel's d96.
    gluon_mse = ("tq_kmse3_v4_d128_", "tq_kmse4_v4_d128_", "tq_kmse3_v3_d128_", "tq_kmse4_v4_d64_", "tq_kmse3_v4_d256_")
    # These tables timed the MSE slots launches of one stage on the tl.dot kernel (before 2026-12-07): their rule is
    # priced here with the ring it then took at every shape, its stage rule on the H100 tables (the test below).
    ratios = (_heuristic_ratios(fp8_module, [t for t in tables if t[0].startswith("tq_kfp8_")])
              + _heuristic_ratios(gluon_mse_module, [t for t in tables if t[0].startswith(gluon_mse)],
                                  _in_the_ring(gluon_mse_module))
              + _heuristic_ratios(mse_module, [t for t in tables if not t[0].startswith(("tq_kfp8_", *gluon_mse))]))
    assert len(ratios) >= 76
    assert _geomean(ratios) < 1.03 and max(ratios) < 1.15


def _in_the_ring(module):
    """The module's heuristic_launch with the ring of 2 at every shape."""
    def rule(batch, num_kv_heads, context, sm_count):
        block_kv, num_warps, _, num_splits = module.heuristic_launch(batch, num_kv_heads, context, sm_count)
        return block_kv, num_warps, 2, num_splits
    return rule


def test_the_mse_slots_heuristic_loads_short_splits_where_used(tmp_path):
    """The Gluon stage 1 on slots with MSE keys: up to 8 sequences, a split of at most 8 tiles loads its words
    where used (1 stage), else the ring of 2. Priced on the committed H100 files' buckets of batch 1-8 (their tunes
    of 2026-12-07 timed every launch there, one stage on the Gluon kernel): closer to each bucket's best than the
    ring at every shape, in every file. A 16-bit query, rotated in stage 1 on this kernel (the only rotation those
    tunes timed at head_dim 128)."""
    module = emit.load(make_config("k3v4"), tmp_path)  # the rule of every head dim the Gluon kernel takes
    assert module.heuristic_launch(1, 8, 4096, 132)[2] == 1 and module.heuristic_launch(1, 8, 65536, 132)[2] == 2
    assert module.heuristic_launch(32, 8, 1024, 132)[2] == 2  # above 8 sequences the ring
    stems = ["tq_kmse3_v4_d128_p16_nc_hadamard_sm90", "tq_kmse4_v4_d128_p16_nc_hadamard_sm90",
             "tq_kmse3_v3_d128_p16_nc_hadamard_sm90", "tq_kmse4_v4_d64_p16_nc_hadamard_sm90",
             "tq_kmse3_v4_d256_p16_nc_hadamard_sm90"]
    everywhere = []
    for stem in stems:
        document = json.loads((REPO / "tuned" / "NVIDIA_H100_80GB_HBM3" / f"{stem}.json").read_text())
        buckets = ((bucket_bounds(key), entry) for key, entry in document["buckets"].items())
        tables = [(stem, bounds, entry) for bounds, entry in buckets if bounds["batch"][1] <= 8]
        assert len(tables) >= 4, stem
        rotate = True if "_d128_" in stem else None  # head_dim 64 and 256: stage 1 does not rotate
        ratios = _heuristic_ratios(module, tables, rotate_query=rotate)
        in_the_ring = _heuristic_ratios(module, tables, _in_the_ring(module), rotate_query=rotate)
        assert _geomean(ratios) < min(1.06, _geomean(in_the_ring)), stem
        assert max(ratios) < 1.2, stem
        everywhere += ratios
    assert _geomean(everywhere) < 1.03


def test_the_split_rule_fit_costs_the_shipped_slots_mse_rule(tmp_path):
    """tools/fit_split_rule.py over the H200 k3v4 slots table (the Gluon kernel's 32-token tiles in the ring of
    2): the heuristic's own split rule (8 programs per SM, a split per 1024 tokens, one per 64 at most, at most 16
    from the SM count) is among the rules whose picks were all timed, within 1% of the best it finds, and every
    rule costs at least the table's best (ratios >= 1)."""
    config = config_mod.resolve_arch(config_mod.load(REPO / "configs" / "k3v4-d128.yaml"), (9, 0))
    table = _h200_table(config)
    results = fit_split_rule.rule_costs(emit.load(config, tmp_path), table, tile=32, warps=1, stages=2)
    shipped = next(result for result in results if result[2:] == (8, 1024, 64, 16))
    assert shipped[0] <= results[0][0] * 1.01
    assert all(geomean >= 1 and worst >= geomean for geomean, worst, *_ in results)


def _h200_planes_module_and_tables(preset, group_size, tmp_path):
    """A planes module of `preset` deciding launches as on the H200 its tables were timed on (the Gluon kernel,
    132 SMs), and the H200 tables of `group_size` query heads per KV head for it."""
    module = emit.load(make_config(preset, cache_layout="planes", arch="sm90"), tmp_path)
    module._mma_stage1_ready = lambda device: True
    module._sm_count = lambda device: 132
    stem = f"_kfp8_v{preset[3]}_" if preset[1] == "8" else f"_kmse{preset[1]}_v{preset[3]}_"
    tables = [t for t in _timing_tables(planes=True) if stem in t[0] and t[1]["group_size"] == group_size]
    return module, tables


# The Gluon kernel with its cp.async ring and packed key selectors, every planes preset re-tuned with the query's
# rotation timed both ways up to 8 sequences (twice the candidates there, so the best is the least of more noisy
# timings): k8v4 2026-12-02, the MSE presets 2026-12-03, after the rotation of 16-bit queries moved to the tensor
# cores (32-token tiles at batch <= 8 refit); the batch 2 and 4 buckets of all four tuned 2026-12-03 (splits of 64
# tokens up to 4 sequences refit; 1 x 65536 re-tuned 2026-12-04 with 128 splits, which the MSE presets' rule then
# took). Geomeans k8v4 1.025, k4v4 1.024, k3v4 1.012, k3v3 1.011; the worst picks k8v4
# at 1 x 4096 (17%: 64 splits, 32 won), k4v4 and k3v4 at 2 x 4096 (14%, 13%: 64 splits, 32 won), k3v3 at 1 x 1024
# (8%: 1 stage, 2 won).
@pytest.mark.parametrize("preset,geomean,worst", [("k8v4", 1.03, 1.19), ("k4v4", 1.03, 1.14), ("k3v4", 1.015, 1.14),
                                                  ("k3v3", 1.015, 1.09)])
def test_planes_heuristic_is_close_to_the_measured_best_on_the_h200(tmp_path, preset, geomean, worst):
    """The same for the page-planar configs, whose heuristic differs (1 warp, and the Gluon kernel's
    rules; sm90, as tuned: fp8 keys have the Gluon kernel only where the arch converts e4m3)."""
    # The rule is fitted to 4 query heads per KV head; the tables of 1, 8 and 16 price it higher, and those group
    # sizes take rules of their own (the tests below).
    module, tables = _h200_planes_module_and_tables(preset, 4, tmp_path)
    ratios = _heuristic_ratios(module, tables)
    assert len(ratios) >= 4
    assert _geomean(ratios) < geomean and max(ratios) < worst


# The 8-head rule's cost per preset on the H200 tables (geometric mean, worst) and heuristic_launch's.
EIGHT_HEAD_RULE_COSTS = {"k4v4": (1.02, 1.15), "k3v4": (1.02, 1.15), "k3v3": (1.02, 1.15), "k8v4": (1.02, 1.12)}


@pytest.mark.parametrize("preset", sorted(EIGHT_HEAD_RULE_COSTS))
def test_eight_heads_per_kv_head_take_their_own_rule_close_to_the_measured_best(tmp_path, preset):
    """5-8 query heads per KV head (the Gluon kernel's 8 columns all heads) take _mma_full_columns_launch in the
    planes configs; its picks, looked up in the H200 tables of 8 heads per KV head (all 28 buckets),
    cost at most 1.02x the best per bucket on geometric mean and 1.15x at worst (k4v4 1.013x and 1.07x, k3v4
    1.008x and 1.07x, k3v3 1.016x and 1.08x, k8v4 1.014x and 1.11x), where heuristic_launch (fitted to 4 heads)
    cost 1.04-1.07x and 1.28-1.39x."""
    module, tables = _h200_planes_module_and_tables(preset, 8, tmp_path)
    cuda = torch.device("cuda", 0)
    assert module.decode_launch_defaults(32, 8, 8, 16384, cuda) == module._mma_full_columns_launch(32, 8, 16384, 132)
    assert module.decode_launch_defaults(32, 8, 6, 16384, cuda) == module._mma_full_columns_launch(32, 8, 16384, 132)
    assert module.decode_launch_defaults(32, 8, 4, 16384, cuda) == module.heuristic_launch(32, 8, 16384, 132)
    ratios = _heuristic_ratios(module, tables, rule=module._mma_full_columns_launch)
    assert len(ratios) == 28
    geomean, worst = EIGHT_HEAD_RULE_COSTS[preset]
    assert _geomean(ratios) < geomean and max(ratios) < worst
    # What the rule is for, on the buckets where both picks were timed: heuristic_launch's 128 splits at 1 x 65536
    # (fitted to 4 heads per KV head) are not in k3v4's and k4v4's tables of 8 heads, tuned before 128 was a candidate.
    pairs = [(heuristic, rule) for heuristic, rule in zip(_ratios_by_bucket(module, tables), ratios)
             if heuristic is not None]
    assert len(pairs) >= 27
    assert _geomean([heuristic for heuristic, _ in pairs]) > _geomean([rule for _, rule in pairs]) + 0.02


@pytest.mark.parametrize("preset", ["k4v4", "k3v4", "k3v3"])
def test_one_head_per_kv_head_takes_its_own_rule_close_to_the_measured_best(tmp_path, preset):
    """One query head per KV head (MHA) takes _mma_one_head_launch in the MSE planes configs; its picks, looked up in
    the H200 tables of 1 head per KV head (all 28 buckets), cost at most 1.02x the best per bucket on
    geometric mean and 1.2x at worst (2026-12-04: 1.015-1.018x, 1.12-1.20x), where heuristic_launch (fitted to
    4 heads) cost 1.035-1.039x."""
    module, tables = _h200_planes_module_and_tables(preset, 1, tmp_path)
    cuda = torch.device("cuda", 0)
    assert module.decode_launch_defaults(32, 8, 1, 16384, cuda) == module._mma_one_head_launch(32, 8, 16384, 132)
    assert module.decode_launch_defaults(32, 8, 2, 16384, cuda) == module.heuristic_launch(32, 8, 16384, 132)
    ratios = _heuristic_ratios(module, tables, rule=module._mma_one_head_launch)
    assert len(ratios) == 28
    assert _geomean(ratios) < 1.02 and max(ratios) < 1.2
    assert _geomean(_heuristic_ratios(module, tables)) > _geomean(ratios) + 0.015  # what the rule is for


@pytest.mark.parametrize("preset", ["k4v4", "k3v4", "k3v3"])
def test_sixteen_heads_per_kv_head_take_the_wide_launch_of_their_own_splits(tmp_path, preset):
    """9-16 query heads per KV head take _mma_wide_launch from _mma_wide_heads_splits in the MSE planes configs;
    where the H200 tables of 16 heads per KV head timed the launch it gives (16 of 28 buckets: the
    others take the one-wave cap's 1-49 splits), it costs at most 1.02x the best per bucket on geometric mean
    and 1.12x at worst (2026-12-04: 1.009-1.013x and 1.07-1.10x), where starting from heuristic_launch's splits
    (fitted to 4 heads per KV head) cost 1.12x and 1.69x."""
    module, tables = _h200_planes_module_and_tables(preset, 16, tmp_path)
    cuda = torch.device("cuda", 0)
    assert len(tables) == 28

    def wide_rule(batch, num_kv_heads, context, sm_count):
        return module.decode_launch_defaults(batch, num_kv_heads, 16, context, cuda)

    def from_heuristic_splits(batch, num_kv_heads, context, sm_count):
        narrow = module.heuristic_launch(batch, num_kv_heads, context, sm_count)[3]
        return module._mma_wide_launch(narrow, batch * num_kv_heads, 16, sm_count)

    def timed(rule):
        return [t for t in tables if tuned_files.candidate_id(dict(zip(
            tuned_files.LAUNCH_FIELDS, rule(t[1]["batch"][1], 8, t[1]["context"][1], 132)))) in
            {name.removesuffix("_rq").removesuffix("_pq") for name in t[2]["timings_us"]}]

    assert module.decode_launch_defaults(32, 8, 16, 16384, cuda) == module._mma_wide_launch(
        module._mma_wide_heads_splits(256, 16384, 132), 256, 16, 132)
    ratios = _heuristic_ratios(module, timed(wide_rule), rule=wide_rule)
    assert len(ratios) == 16
    assert _geomean(ratios) < 1.02 and max(ratios) < 1.12
    before = _heuristic_ratios(module, timed(from_heuristic_splits), rule=from_heuristic_splits)
    assert _geomean(before) > 1.1 and max(before) > 1.5


def test_a_bucket_without_valid_candidates_fails_alone(setup, tmp_path, monkeypatch):
    real = tuner.tune_bucket

    def first_bucket_fails(module, config, group_size, batch, context, space, **kwargs):
        if batch == 2:
            raise TqgenError("bucket g2_b2_t256: every candidate was rejected (test)")
        return real(module, config, group_size, batch, context, space, **kwargs)

    monkeypatch.setattr(tuner, "tune_bucket", first_bucket_fails)
    lines = []
    with pytest.raises(TqgenError, match=r"1 of 2 buckets have no valid candidate \(g2_b2_t256\)"):
        run_tune(setup, tmp_path, progress=lines.append)
    assert "FAILED" in lines[0] and "best" in lines[1]  # the next bucket was still tuned and saved
    config, _ = setup
    assert list(json.loads(tuned_files.tuned_path(tmp_path, "Test GPU", config).read_text())["buckets"]) == ["g2_b1_t256"]


SHIPPED = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_committed_tuned_files_are_current(path):
    """Every shipped config has launches of a Hopper GPU (the H200, or the H100 where its decode kernels changed
    since the H200 was last lent) that a build still bakes: a decode kernel change needs a re-tune."""
    from tqgen import config as config_mod

    config = config_mod.resolve_arch(config_mod.load(path), (9, 0))
    warnings = []
    baked = tuned_files.baked_launches(REPO / "tuned", config, warnings.append)
    assert not warnings, warnings
    assert set(baked) & {"NVIDIA H200", "NVIDIA H100 80GB HBM3"}, f"no tuned file for {config.artifact_name()}"
    for launches in baked.values():
        assert len(launches["buckets"]) >= 4
        assert f"g4_b32_t{16384}" in launches["buckets"]


def test_stale_tuned_lists_the_configs_a_re_tune_must_redo_with_their_group_sizes(tmp_path):
    """tools/stale_tuned.py (what tools/run_gpu.sh's tune step re-tunes): nothing while the committed files match
    their kernels; a file timed on other decode code is listed with the group sizes it was tuned for."""
    import subprocess
    import sys

    shutil.copytree(REPO / "tuned", tmp_path, dirs_exist_ok=True)
    configs = ["configs/k3v4-d128.yaml", "configs/k3v4-d128-planes.yaml"]
    h100 = "NVIDIA H100 80GB HBM3"  # the GPU whose files these configs have

    def stale(device=h100, *options):
        result = subprocess.run([sys.executable, "tools/stale_tuned.py", "--tuned-dir", str(tmp_path), "--device",
                                 device, *options, *configs], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        return result.stdout.splitlines()

    assert stale() == []
    # --include-current (run_gpu.sh's configs named): each config with its file's group sizes, stale or not, and
    # without any where it has no file.
    config = config_mod.resolve_arch(config_mod.load(REPO / configs[1]), (9, 0))
    path = tuned_files.tuned_path(tmp_path, h100, config)
    document = json.loads(path.read_text())
    document["buckets"].update({key.replace("g4_", "g8_", 1): {**entry, "group_size": 8}
                                for key, entry in document["buckets"].items()})
    path.write_text(json.dumps(document))  # a file of two group sizes
    assert stale(h100, "--include-current") == ["configs/k3v4-d128.yaml 4", "configs/k3v4-d128-planes.yaml 4 8"]
    assert stale("NVIDIA H200", "--include-current") == configs
    # A re-tune cut off part way: the current file lacks buckets of the stale one --force set aside. Listed, with
    # both files' group sizes, so that the next run resumes it; not with --stale-only (it needs no --force).
    set_aside = path.with_name(f"{path.name}.replaced-20261206T000000")
    shutil.copy(path, set_aside)
    document["buckets"] = {key: entry for key, entry in document["buckets"].items() if entry["group_size"] == 8}
    path.write_text(json.dumps(document))
    assert stale() == ["configs/k3v4-d128-planes.yaml 4 8"]
    assert stale(h100, "--include-current")[1] == "configs/k3v4-d128-planes.yaml 4 8"
    assert stale(h100, "--stale-only") == []
    shutil.copy(set_aside, path)  # finished: nothing to resume
    assert stale() == []
    set_aside.unlink()
    document = json.loads(path.read_text())
    document["metadata"]["kernel_hash"] = "0" * 64
    path.write_text(json.dumps(document))
    assert stale() == ["configs/k3v4-d128-planes.yaml 4 8"]
    assert stale("NVIDIA H200") == []  # no files of these configs for that GPU: nothing to re-tune


def test_stale_tuned_lists_the_rest_past_a_damaged_tuned_file_and_fails_in_one_line(tmp_path):
    """A tuned file that is not JSON, or JSON of another shape, is stale too (a build ignores it), but its group
    sizes are unknown: one line on stderr names it, the configs after it are still listed, and the exit status is 1.
    A config that does not exist is one line naming it, not a traceback."""
    import subprocess
    import sys

    shutil.copytree(REPO / "tuned", tmp_path, dirs_exist_ok=True)
    h100 = "NVIDIA H100 80GB HBM3"
    damaged = {"configs/k3v4-d128.yaml": "{not json", "configs/k8v4-d128.yaml": json.dumps({"buckets": [1]}),
               "configs/k4v4-d128.yaml": json.dumps({"metadata": {}, "buckets": {"g4_b32_t8192": {}}})}
    for config_path, text in damaged.items():
        config = config_mod.resolve_arch(config_mod.load(REPO / config_path), (9, 0))
        tuned_files.tuned_path(tmp_path, h100, config).write_text(text)
    config = config_mod.resolve_arch(config_mod.load(REPO / "configs/k3v4-d128-planes.yaml"), (9, 0))
    path = tuned_files.tuned_path(tmp_path, h100, config)
    document = json.loads(path.read_text())
    document["metadata"]["kernel_hash"] = "0" * 64
    path.write_text(json.dumps(document))
    groups = " ".join(str(group) for group in sorted({entry["group_size"] for entry in document["buckets"].values()}))

    def stale(*configs):
        return subprocess.run([sys.executable, "tools/stale_tuned.py", "--tuned-dir", str(tmp_path), "--device", h100,
                               *configs], cwd=REPO, capture_output=True, text=True, timeout=300)

    result = stale(*damaged, "configs/k3v4-d128-planes.yaml")
    assert result.returncode == 1 and result.stdout.splitlines() == [f"configs/k3v4-d128-planes.yaml {groups}"]
    errors = result.stderr.splitlines()
    assert len(errors) == 3 and "Traceback" not in result.stderr, result.stderr
    for error, config_path in zip(errors, damaged):
        assert "NVIDIA_H100_80GB_HBM3/tq_" in error and config_path in error, error
    result = stale("configs/no-such-config.yaml")
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.splitlines()) == 1 and "no-such-config.yaml" in result.stderr


def test_stale_tuned_reads_the_shipped_configs_whatever_the_working_directory(tmp_path):
    """Run from elsewhere (another checkout, whose configs/ may differ), the default list is this repository's
    configs; a config named relative to the working directory is read there, else in the repository."""
    import subprocess
    import sys

    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "configs").mkdir(parents=True)
    (elsewhere / "configs" / "k3v4-d128-planes.yaml").write_text("not: [a, config\n")
    shutil.copy(REPO / "configs" / "k8v4-d128.yaml", elsewhere / "mine.yaml")

    def stale(*configs):
        result = subprocess.run([sys.executable, str(REPO / "tools" / "stale_tuned.py"), *configs], cwd=elsewhere,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        return result.stdout.splitlines()

    assert stale() == []
    assert stale("mine.yaml", "configs/k3v4-d128.yaml") == []


def test_stale_tuned_finds_the_files_of_a_gpu_of_another_arch(tmp_path):
    """A GPU not in its table has its files under its own arch's names: --capability says which (tools/run_gpu.sh
    passes torch's), and without it such a GPU's folder is a one-line error, not a silent empty list; a GPU with no
    folder is a note that there is nothing to re-tune."""
    import subprocess
    import sys

    device = "NVIDIA A100-SXM4-80GB"
    config = config_mod.resolve_arch(config_mod.load(REPO / "configs/k3v4-d128-planes.yaml"), (8, 0))
    path = tuned_files.tuned_path(tmp_path, device, config)
    path.parent.mkdir()
    committed = REPO / "tuned" / "NVIDIA_H100_80GB_HBM3" / path.name.replace("sm80", "sm90")
    document = json.loads(committed.read_text())
    document["metadata"]["device_name"] = device  # and a kernel_hash of sm90's kernels: stale for sm80
    path.write_text(json.dumps(document))
    groups = " ".join(str(group) for group in sorted({entry["group_size"] for entry in document["buckets"].values()}))

    def stale(*arguments):
        return subprocess.run([sys.executable, "tools/stale_tuned.py", "--tuned-dir", str(tmp_path), *arguments,
                               "configs/k3v4-d128-planes.yaml"], cwd=REPO, capture_output=True, text=True, timeout=300)

    result = stale("--device", device, "--capability", "8.0")
    assert result.returncode == 0 and result.stdout.splitlines() == [f"configs/k3v4-d128-planes.yaml {groups}"]
    result = stale("--device", device)
    assert result.returncode != 0 and len(result.stderr.splitlines()) == 1 and "--capability" in result.stderr
    result = stale("--device", device, "--capability", "eight")
    assert result.returncode != 0 and "--capability" in result.stderr and "Traceback" not in result.stderr
    result = stale("--device", "NVIDIA B200")
    assert result.returncode == 0 and result.stdout == "" and "no tuned files for NVIDIA B200" in result.stderr


def test_only_decode_kernel_edits_invalidate_a_tuned_file(setup, tmp_path, monkeypatch):
    """The tuning is keyed on the code the tuner timed (render.decode_kernel_hash): an edit to the
    code of any definition that decode's launch reaches (its kernels, their helpers, the launch code)
    drops it; comments and docstrings there, and code of the store, dequantize or the launch heuristic,
    keep it."""
    config, _ = setup
    path, _ = run_tune(setup, tmp_path / "tuned", buckets=BUCKETS[:1])
    copy = tmp_path / "templates"
    shutil.copytree(render.template_dir(), copy)
    monkeypatch.setattr(render, "template_dir", lambda: copy)
    warnings = []

    def edit(name, old, new):
        text = (copy / name).read_text()
        assert text.count(old) == 1, (name, old)
        (copy / name).write_text(text.replace(old, new))
        return text

    keeps = [  # (template, text, replacement)
        ("store/kernel.py.jinja", "    value = value.to(tl.float32)\n", "    value = value.to(tl.float32) + 0.0\n"),
        ("dequantize/kernel.py.jinja", "    values = value_codes * value_scale", "    values = 1.0 * value_codes * value_scale"),
        ("decode/heuristic.py.jinja", "        return 4  # the interpreter", "        return 2  # the interpreter"),
        ("decode/stage2.py.jinja", "    lse_max = tl.max(lse, axis=0)\n", "    # a comment\n    lse_max = tl.max(lse, axis=0)\n"),
        ("decode/stage1.py.jinja", "    so scale and zero cost per token", "    so scale and zero (a docstring edit) cost per token"),
    ]
    drops = [
        ("decode/stage1.py.jinja", "    running_sum = tl.zeros([BLOCK_H], tl.float32)\n",
         "    running_sum = tl.zeros([BLOCK_H], tl.float32) * 1.0\n"),
        ("decode/stage2.py.jinja", "    lse_max = tl.max(lse, axis=0)\n", "    lse_max = tl.max(lse, axis=0) + 0.0\n"),
        ("decode/prepare.py.jinja", "    row_mask = rows < num_rows\n", "    row_mask = (rows < num_rows) & True\n"),
        ("decode/launch.py.jinja", "    block_h = max(16, _next_power_of_2(group_size))",
         "    block_h = max(16, _next_power_of_2(group_size), 1)"),
        ("shared/fields.py.jinja", "bitcast=True) - 1024.0", "bitcast=True) - 1024.0 + 0.0"),
    ]
    for name, old, new in keeps:
        pristine = edit(name, old, new)
        assert "Test GPU" in tuned_files.baked_launches(tmp_path / "tuned", config, warnings.append), name
        assert not warnings, warnings
        (copy / name).write_text(pristine)
    for name, old, new in drops:
        pristine = edit(name, old, new)
        assert tuned_files.baked_launches(tmp_path / "tuned", config, warnings.append) == {}, name
        assert "kernel_hash" in warnings[-1] and str(path) in warnings[-1]
        (copy / name).write_text(pristine)
    assert len(warnings) == len(drops)


def test_the_decode_hash_covers_what_the_decode_launch_reaches_and_not_launch_selection():
    """render.decode_path: from _run_decode, every kernel and helper decode runs, never the tuned table
    or the heuristic (they choose launches; the tuner passes every launch parameter)."""
    for stem in ("k3v4-d128-planes", "k8v4-d128"):
        from tqgen import config as config_mod

        config = config_mod.resolve_arch(config_mod.load(REPO / "configs" / f"{stem}.yaml"), (9, 0))
        reached = set(render.decode_path(render.render(config)))
        assert {"tq_decode_stage1", "tq_decode_stage2", "_run_decode", "_load_value_words"} <= reached
        assert ("tq_prepare_query" in reached) == (config.key_format == "mse")
        assert ("tq_decode_stage1_mma" in reached) == ("_mma_stage1_constants" in reached) == (
            Plan.from_config(config).mma_stage1)
        assert not reached & {"TUNED_LAUNCHES", "decode_launch", "heuristic_launch", "decode", "tq_store",
                              "tq_dequantize", "store", "dequantize"}


def test_a_waiter_on_a_lock_file_deleted_by_its_holder_locks_the_new_one(tmp_path):
    """The holder deletes `<path>.lock` when done; a waiter that opened the old file before the deletion must not
    count its lock on the deleted inode as the lock: it locks the name's current file."""
    import fcntl
    import threading

    path = tmp_path / "tuned.json"
    inside, order = threading.Event(), []
    lock_path = path.with_name(path.name + ".lock")

    def holder():
        with tuned_files.locked(path):
            order.append("holder in")
            inside.set()
            time.sleep(0.3)
            order.append("holder out")

    thread = threading.Thread(target=holder)
    thread.start()
    inside.wait(10)
    stale = open(lock_path, "a+")  # opened before the holder deletes the name
    with tuned_files.locked(path, timeout_s=10):
        order.append("waiter in")
        # The waiter holds the file the name now refers to, not the deleted one the stale handle points to.
        assert os.stat(lock_path).st_ino != os.fstat(stale.fileno()).st_ino
        fcntl.flock(stale.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # the deleted inode is free
    stale.close()
    thread.join(10)
    assert order == ["holder in", "holder out", "waiter in"] and not lock_path.exists()


def test_screening_retimes_only_the_finalists_and_keeps_the_fastest(setup):
    """With a screen timer every candidate is screened, and only those within SCREEN_MARGIN of the fastest are
    timed again by the full timer; the entry names them and keeps the best of all recorded timings."""
    config, module = setup
    screened = iter([10.0, 10.4, 12.0, 30.0])  # ms, in SPACE's candidate order
    final = iter([11.0, 9.0])  # ms, the finalists from the fastest screening on
    screen_calls, final_calls = [], []

    def screen_timer(fn):
        screen_calls.append(fn)
        return next(screened)

    def timer(fn):
        final_calls.append(fn)
        return next(final)

    entry = tuner.tune_bucket(module, config, 2, 1, 100, SPACE, timer=timer, screen_timer=screen_timer,
                              num_kv_heads=1, device="cpu")
    ids = [tuned_files.candidate_id(launch) for launch in candidates(module, 1)]
    assert len(screen_calls) == 4 and final_calls == screen_calls[:2]
    assert entry["retimed"] == ids[:2]
    assert entry["timings_us"] == {ids[1]: 9000.0, ids[0]: 11000.0, ids[2]: 12000.0, ids[3]: 30000.0}
    assert tuned_files.candidate_id(entry["best"]) == ids[1] and entry["best_us"] == 9000.0


def test_screening_picks_the_winner_among_the_finalists(setup, monkeypatch):
    """The winner is the fastest finalist by the full timer: a candidate that was not retimed (screened slower than
    the margin, or past SCREEN_FINALISTS) does not win by its screening time against the finalists' full times (the
    full run may read a few percent above the screening; it once won on 10.6 ms screened against 11.0 ms in full
    for the candidate screened at 10.0 ms)."""
    config, module = setup
    ids = [tuned_files.candidate_id(launch) for launch in candidates(module, 1)]
    for screened, final, finalists in [([10.0, 10.6, 12.0, 30.0], [11.0], 1),  # the second is past the margin
                                       ([10.0, 10.1, 10.2, 30.0], [10.5, 10.4], 2)]:  # the third is past the cap
        monkeypatch.setattr(tuner, "SCREEN_FINALISTS", finalists)
        screen_times, final_times = iter(screened), iter(final)
        entry = tuner.tune_bucket(module, config, 2, 1, 100, SPACE, timer=lambda fn: next(final_times),
                                  screen_timer=lambda fn: next(screen_times), num_kv_heads=1, device="cpu")
        assert entry["retimed"] == ids[:finalists]
        best = tuned_files.candidate_id(entry["best"])
        assert best in entry["retimed"] and entry["best_us"] == min(final) * 1e3, (best, entry["timings_us"])


def test_compile_classes_take_each_group_and_batch_once_at_a_small_context():
    shapes = [(4, 1, 65536), (4, 1, 1024), (4, 32, 16384), (4, 32, 65536), (8, 1, 4096), (4, 2, 300)]
    assert sorted(tuner.compile_classes(shapes)) == [(4, 1, 1024), (4, 2, 300), (4, 32, 4096), (8, 1, 4096)]


def test_a_compile_worker_runs_every_candidate_and_counts_the_failures(setup, monkeypatch):
    """What each precompile process does for one class: every candidate's check and whole call, once; a
    candidate that raises is counted, not fatal (the tuner records its reason when it meets it)."""
    config, module = setup
    launches = []
    original = module.decode

    def recording(*args, **kwargs):
        launches.append(kwargs["num_splits"])
        if kwargs["num_splits"] == 2:
            raise RuntimeError("does not compile")
        return original(*args, **kwargs)

    monkeypatch.setattr(module, "decode", recording)
    monkeypatch.setattr(tuner, "_loaded_module", lambda path: module)
    failed = tuner._compile_class(module.__file__, config, 2, 1, 100, SPACE, 1, "cpu")
    assert failed == 2  # kv32 and kv64 at 2 splits
    assert sorted(launches) == [1, 1, 1, 1, 2, 2]  # check and whole call of each 1-split candidate; 2 fail at once


def test_a_compile_class_compiles_every_launch_its_buckets_time_once(setup, monkeypatch):
    """With shortlists, a (group size, batch) class compiles the union of its buckets' launches, each once, and a
    worker given launches runs those alone."""
    config, module = setup
    one, two, four = ({"block_kv": 32, "num_warps": 1, "num_stages": 1, "num_splits": s} for s in (1, 2, 4))
    launches_of = {(2, 1, 256): [one, two], (2, 1, 1024): [two, four], (2, 2, 256): [four]}
    assert tuner._class_launches(list(launches_of), launches_of, 2, 1) == [one, two, four]
    assert tuner._class_launches(list(launches_of), launches_of, 2, 2) == [four]
    assert tuner._class_launches(list(launches_of), None, 2, 1) is None
    splits = []
    original = module.decode

    def recording(*args, **kwargs):
        splits.append(kwargs["num_splits"])
        return original(*args, **kwargs)

    monkeypatch.setattr(module, "decode", recording)
    monkeypatch.setattr(tuner, "_loaded_module", lambda path: module)
    assert tuner._compile_class(module.__file__, config, 2, 1, 100, SPACE, 1, "cpu", launches=[two]) == 0
    assert splits == [2, 2]  # its check and its whole call


def test_precompile_runs_nothing_on_one_worker_or_off_cuda(setup, monkeypatch):
    config, module = setup
    monkeypatch.setattr(tuner, "_compile_class", lambda *args: pytest.fail("no worker may start"))
    lines = []
    tuner.precompile(module, config, BUCKETS, SPACE, workers=1, device="cuda", progress=lines.append)
    tuner.precompile(module, config, BUCKETS, SPACE, workers=8, device="cpu", progress=lines.append)
    assert lines == []


def test_an_interrupted_precompile_starts_no_more_classes(setup, monkeypatch):
    """Ctrl-C while the candidates compile: the pool's exit waited for every class still queued (each 30-40 s of
    compiling on the H200) before the interrupt got through. Worker threads stand in for the processes."""
    import concurrent.futures

    config, module = setup

    class Threads(concurrent.futures.ThreadPoolExecutor):
        def __init__(self, workers, mp_context=None):
            super().__init__(workers)

    started = []

    def compile_class(module_file, config, group_size, batch, context, space, num_kv_heads, device, launches=None):
        started.append(batch)
        if batch == 1:  # the interrupt, as a worker hands it back to the tuner
            raise KeyboardInterrupt
        time.sleep(0.5)
        return 0

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", Threads)
    monkeypatch.setattr(tuner, "_compile_class", compile_class)
    shapes = [(2, batch, 256) for batch in range(1, 9)]
    with pytest.raises(KeyboardInterrupt):
        tuner.precompile(module, config, shapes, SPACE, workers=2, device="cuda", progress=lambda line: None)
    assert len(started) < len(shapes) // 2, started

def _unwritable_roots(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    roots = [blocker / "tuned"]
    if Path("/proc/self").is_dir():
        roots.append(Path("/proc/tqgen-tuned"))  # takes no new folders, even from root
    return roots


@pytest.mark.parametrize("root_kind", ["under-a-file", "proc"])
@pytest.mark.parametrize("force", [False, True])
def test_tuning_into_an_unwritable_folder_fails_with_one_line_before_timing(setup, tmp_path, force, root_kind):
    config, module = setup
    roots = _unwritable_roots(tmp_path)
    if root_kind == "proc" and len(roots) < 2:
        pytest.skip("needs Linux's /proc")
    for root in roots[:1] if root_kind == "under-a-file" else roots[1:]:
        with pytest.raises(TqgenError, match="cannot be written") as caught:
            tuner.tune(config, module, [(1, 1, 100)], SPACE, root=root, fingerprint=FINGERPRINT,
                       timer=lambda fn: pytest.fail("timed a bucket it cannot save"), num_kv_heads=1,
                       device="cpu", force=force, progress=lambda line: None)
        assert "\n" not in str(caught.value)


def test_a_failed_save_of_a_tuned_bucket_is_one_line_and_keeps_the_file(setup, tmp_path, monkeypatch):
    config, _ = setup
    metadata = tuned_files.make_metadata(config, FINGERPRINT)
    path = tuned_files.tuned_path(tmp_path, "Test GPU", config)
    entry = {"best": {"block_kv": 32, "num_warps": 1, "num_stages": 1, "num_splits": 1}}
    tuned_files.save_bucket(path, metadata, "g1_b1_t256", entry)
    before = path.read_bytes()
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(TqgenError) as caught:
        tuned_files.save_bucket(path, metadata, "g1_b2_t256", entry)
    monkeypatch.undo()
    assert "\n" not in str(caught.value) and "No space left on device" in str(caught.value)
    assert path.read_bytes() == before and sorted(p.name for p in path.parent.iterdir()) == [path.name]
