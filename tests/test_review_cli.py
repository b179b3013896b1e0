"""Reproducers of robustness defects in the tuned files and the tune's file handling (CPU)."""

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import triton

from conftest import INTERPRET, make_config
from tqgen import emit, tuned_files, tuner
from tqgen.errors import TqgenError

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CPU tuning runs under the interpreter")

REPO = Path(__file__).resolve().parent.parent
SM90_YAML = "key_format: mse\nkey_bits: 3\nvalue_bits: 4\nhead_dim: 128\narch: sm90\n"
SHIPPED = REPO / "tuned" / "NVIDIA_H200" / "tq_kmse3_v4_d128_p16_nc_hadamard_sm90.json"
FINGERPRINT = {"device_name": "Test GPU", "compute_capability": "9.0", "sm_count": 4,
               "triton_version": triton.__version__, "torch_version": torch.__version__.split("+")[0]}
SPACE = tuner.SearchSpace(block_kv=(32,), num_warps=(1,), num_stages=(1,), num_splits=(1,), merge_in_stage1=(False,))


def tqgen(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "tqgen.cli", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def _drop(field):
    return lambda document: document["metadata"].pop(field)


def _first_best(field, value):
    return lambda document: next(iter(document["buckets"].values()))["best"].__setitem__(field, value)


@pytest.mark.parametrize("damage", [
    pytest.param(lambda d: d["buckets"].__setitem__("default", next(iter(d["buckets"].values()))), id="odd-bucket-key"),
    pytest.param(_drop("device_name"), id="no-device-name"),
    pytest.param(lambda d: d["metadata"].__setitem__("device_name", None), id="null-device-name"),
    pytest.param(_drop("triton_version"), id="no-triton-version"),
    pytest.param(_first_best("block_kv", -1), id="negative-block-kv"),
    pytest.param(_first_best("num_warps", True), id="boolean-warps"),
])
@pytest.mark.parametrize("command", ["build", "show"])
def test_a_damaged_tuned_file_is_reported_and_ignored_by_build_and_show(tmp_path, damage, command):
    document = json.loads(SHIPPED.read_text())
    damage(document)
    tuned = tmp_path / "tuned" / "NVIDIA_H200"
    tuned.mkdir(parents=True)
    (tuned / SHIPPED.name).write_text(json.dumps(document))
    config = tmp_path / "sm90.yaml"
    config.write_text(SM90_YAML)
    extra = ["-o", tmp_path / "out"] if command == "build" else []
    result = tqgen(command, config, "--tuned-dir", tmp_path / "tuned", *extra)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert f"tqgen: ignoring {tuned / SHIPPED.name}" in result.stderr + result.stdout
    assert "none" in result.stdout


def cpu_timer(fn):
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    config = make_config("k3v4", head_dim=64)
    return config, emit.load(config, tmp_path_factory.mktemp("modules"))


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


@pytest.mark.parametrize("option, value", [("--kv-heads", "0"), ("--kv-heads", "-2"), ("--group-size", "0"),
                                           ("--group-size", "-1")])
def test_tune_refuses_non_positive_heads_with_one_line_before_tuning(tmp_path, monkeypatch, capsys, option, value):
    from tqgen import cli

    # As on a GPU, but nothing may be tuned: the check comes first.
    monkeypatch.setattr(cli, "_cuda_available", lambda: True)
    monkeypatch.setattr(tuned_files, "device_fingerprint", lambda: FINGERPRINT)
    monkeypatch.setattr(tuner, "tune", lambda *a, **k: pytest.fail("tuned with a bad option"))
    config = tmp_path / "k3v4.yaml"
    config.write_text("key_format: mse\nkey_bits: 3\nvalue_bits: 4\nhead_dim: 64\n")
    status = cli.main(["tune", str(config), "--tuned-dir", str(tmp_path / "tuned"), "--cache-dir", str(tmp_path / "c"),
                       "--batch", "1", "--context", "100", "--compile-workers", "1", option, value])
    stderr = capsys.readouterr().err
    assert status == 2 and stderr.startswith("tqgen: error: tune: ") and stderr.count("\n") == 1, stderr
    assert option in stderr


@pytest.mark.parametrize("where", ["under-a-file", "proc"])
def test_bench_json_to_a_folder_that_takes_no_files_fails_with_one_line(tmp_path, monkeypatch, capsys, where):
    from tqgen import bench, cli

    # As on a GPU, with a stand-in for the timed store (the JSON is written after every timing).
    monkeypatch.setattr(cli, "_cuda_available", lambda: True)
    monkeypatch.setattr(bench, "copy_ceiling_gbps", lambda: 1000.0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Test GPU")
    monkeypatch.setattr(bench, "bench_store", lambda module, config, tokens, **k: bench.OpRow(
        config=config.name, op="store", shape=f"{tokens} tokens", graph_us=1.0, nbytes=1, gbps=1.0, ceiling_pct=0.1))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    if where == "proc" and not Path("/proc/self").is_dir():
        pytest.skip("needs Linux's /proc")
    target = blocker / "bench.json" if where == "under-a-file" else Path("/proc/bench.json")  # /proc: no new files
    status = cli.main(["bench", str(REPO / "configs/k3v4-d128.yaml"), "--ops", "store", "--store-tokens", "32",
                       "--cache-dir", str(tmp_path / "c"), "--json", str(target)])
    stderr = capsys.readouterr().err
    assert status == 2 and stderr.startswith("tqgen: error: ") and stderr.count("\n") == 1, stderr
    assert str(target.parent) in stderr
