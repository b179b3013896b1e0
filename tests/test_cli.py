"""The `tqgen` command line, run as a real subprocess (as a user runs it)."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tqgen import config as config_mod
from tqgen import dispatch, tuned_files, tuner
from tqgen import render as render_mod

REPO = Path(__file__).resolve().parent.parent
K3V4 = "configs/k3v4-d128.yaml"
K8V4 = "configs/k8v4-d128.yaml"
GOOD_YAML = "key_format: mse\nkey_bits: 3\nvalue_bits: 4\nhead_dim: 128\n"
SM90_YAML = GOOD_YAML + "arch: sm90\n"
# A committed tuned file of K3V4 for sm90 (the first by GPU folder: tuned/README.md) and the GPU it names.
SHIPPED = sorted((REPO / "tuned").glob("*/tq_kmse3_v4_d128_p16_nc_hadamard_sm90.json"))[0]
SHIPPED_DEVICE = json.loads(SHIPPED.read_text())["metadata"]["device_name"]


def shipped_tuned_file(config_path: str) -> Path:
    """Where SHIPPED_DEVICE's committed tuned file of a config (for sm90) is, if there is one."""
    config = config_mod.resolve_arch(config_mod.load(REPO / config_path), (9, 0))
    return tuned_files.tuned_path(REPO / "tuned", SHIPPED_DEVICE, config)


FINGERPRINT = {"device_name": "Test GPU", "compute_capability": "9.0", "sm_count": 4,
               "triton_version": "3.6.0", "torch_version": "2.11.0"}


def tqgen(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "tqgen.cli", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def dispatcher_name(path) -> str:
    """What `tqgen build` writes for arch auto, on any machine: the dispatcher, named without an arch..."""
    return config_mod.load(REPO / path).artifact_name() + ".py"


def variant_name(path, arch) -> str:
    """...and one module per known arch."""
    return dataclasses.replace(config_mod.load(REPO / path), arch=arch).artifact_name() + ".py"


def built_names(path) -> set:
    return {dispatcher_name(path)} | {variant_name(path, arch) for arch in config_mod.KNOWN_ARCHES}


def assert_one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("tqgen: error: "), result.stderr
    assert result.stderr.endswith("\n") and result.stderr.count("\n") == 1, repr(result.stderr)
    return result.stderr


def folder_is_empty(path: Path) -> bool:
    return not path.exists() or not any(path.iterdir())


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One `tqgen build` of two configs: (result, out_dir, {name: (bytes, stat)})."""
    out = tmp_path_factory.mktemp("cli-build") / "out"
    result = tqgen("build", K3V4, K8V4, "-o", out)
    files = {p.name: (p.read_bytes(), p.stat()) for p in out.iterdir()} if out.is_dir() else {}
    return result, out, files


# --------------------------------------------------------------------------
# build
# --------------------------------------------------------------------------
def test_build_writes_a_dispatcher_and_every_arch_per_config(built):
    result, out, files = built
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert set(files) == built_names(K3V4) | built_names(K8V4)
    assert all(name.startswith("tq_") and name.endswith(".py") for name in files)
    lines = result.stdout.splitlines()
    for config_path in (K3V4, K8V4):  # "config -> dispatcher", then a line per variant with its tuned devices
        assert f"{config_path} -> {out / dispatcher_name(config_path)} (arch auto" in result.stdout
        for arch in config_mod.KNOWN_ARCHES:
            (line,) = [line for line in lines if line.endswith(variant_name(config_path, arch)) or
                       f"{variant_name(config_path, arch)} " in line]
            assert line.startswith(f"  {arch} ")
            assert ("NVIDIA H" in line) == (arch == "sm90") and ("none" in line) == (arch != "sm90")
            assert (f"{SHIPPED_DEVICE} (" in line) == (arch == "sm90" and shipped_tuned_file(config_path).exists())


def test_built_modules_compile(built):
    _, _, files = built
    assert files
    for name, (data, _) in files.items():
        compile(data.decode("utf-8"), name, "exec")


def test_built_module_matches_in_process_render(built):
    # Rendering is deterministic across processes: the CLI's files equal render() here, each variant exactly
    # the module of an explicit-arch config with its tuned launches.
    _, _, files = built
    config = config_mod.load(REPO / K3V4)
    variants = []
    for arch in config_mod.KNOWN_ARCHES:
        explicit = dataclasses.replace(config, arch=arch)
        tuned = tuned_files.baked_launches(REPO / "tuned", explicit, print)
        variants.append(dispatch.Variant(explicit, render_mod.render(explicit, tuned), tuned))
        assert files[variant_name(K3V4, arch)][0] == variants[-1].source.encode("utf-8")
    assert files[dispatcher_name(K3V4)][0] == dispatch.render_dispatcher(config, variants).encode("utf-8")


def test_build_of_an_explicit_arch_writes_that_module_only(tmp_path):
    config = tmp_path / "k3v4-sm90.yaml"
    config.write_text(GOOD_YAML + "arch: sm90\nname: k3v4-d128\n")
    out = tmp_path / "out"
    result = tqgen("build", config, "-o", out)
    assert result.returncode == 0, result.stderr
    explicit = config_mod.load(config)
    (module,) = out.iterdir()
    assert module.name == variant_name(K3V4, "sm90") == f"{explicit.artifact_name()}.py"
    assert module.read_bytes() == render_mod.render(
        explicit, tuned_files.baked_launches(REPO / "tuned", explicit, print)).encode("utf-8")
    buckets = len(tuned_files.baked_launches(REPO / "tuned", explicit, print)[SHIPPED_DEVICE]["buckets"])
    assert result.stdout == f"{config} -> {module} (tuned launches: {SHIPPED_DEVICE} ({buckets} buckets))\n"


def test_second_build_leaves_files_untouched(built):
    result, out, files = built
    assert result.returncode == 0
    again = tqgen("build", K3V4, K8V4, "-o", out)
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(files)  # no leftover temp files either
    for name, (data, stat) in files.items():
        now = (out / name).stat()
        assert (out / name).read_bytes() == data
        assert now.st_mtime_ns == stat.st_mtime_ns, f"{name} was rewritten"
        assert now.st_ino == stat.st_ino, f"{name} was replaced"


def test_build_replaces_a_stale_module(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    stale = out / dispatcher_name(K3V4)
    stale.write_text("# stale\n")
    result = tqgen("build", K3V4, "-o", out)
    assert result.returncode == 0, result.stderr
    assert stale.read_text().startswith("# Generated by tqgen")
    assert {p.name for p in out.iterdir()} == built_names(K3V4)


# --------------------------------------------------------------------------
# errors: exit 2, one line on stderr, nothing written
# --------------------------------------------------------------------------
BAD_CONFIGS = [
    pytest.param(GOOD_YAML + "colour: blue\n", ["colour", "unknown field"], id="unknown-field"),
    pytest.param(GOOD_YAML.replace("value_bits: 4", "value_bits: 5"), ["value_bits", "5"], id="wrong-value"),
    pytest.param(None, ["no such file"], id="missing-file"),
    pytest.param("key_format: [mse\nvalue_bits: 4\n", ["line"], id="unparsable-yaml"),
]


@pytest.mark.parametrize("text, phrases", BAD_CONFIGS)
def test_build_with_a_bad_config_fails_with_one_line(tmp_path, text, phrases):
    bad = tmp_path / "bad.yaml"
    if text is not None:
        bad.write_text(text)
    out = tmp_path / "out"
    stderr = assert_one_line_error(tqgen("build", bad, "-o", out))
    assert str(bad) in stderr
    for phrase in phrases:
        assert phrase in stderr
    assert folder_is_empty(out)


def test_one_bad_config_among_several_writes_none(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(GOOD_YAML + "head_dim_typo: 1\n")
    out = tmp_path / "out"
    result = tqgen("build", K3V4, K8V4, bad, "-o", out)
    stderr = assert_one_line_error(result)
    assert "head_dim_typo" in stderr
    assert folder_is_empty(out)
    assert result.stdout == ""


@pytest.mark.parametrize("other, clash", [(SM90_YAML, variant_name(K3V4, "sm90")), (GOOD_YAML, dispatcher_name(K3V4))],
                         ids=["explicit-arch-over-a-variant", "same-format"])
def test_configs_that_write_one_file_differently_are_refused_before_writing(tmp_path, other, clash):
    """An arch-auto config's sm90 variant and an sm90 config of the same format under another name (or two
    arch-auto configs of one format) write the same files with different bytes: the later build's file
    would replace the earlier's, and a dispatcher refuses a variant it was not built with."""
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text(GOOD_YAML)
    second.write_text(other)
    out = tmp_path / "out"
    result = tqgen("build", first, second, "-o", out)
    stderr = assert_one_line_error(result)
    assert f"{first} and {second} both write {out / clash}, differently (they differ in name)" in stderr
    assert folder_is_empty(out) and result.stdout == ""


def test_configs_that_write_one_file_alike_build(tmp_path):
    """The same config twice, or an explicit-arch config equal to an arch-auto config's variant: same bytes."""
    auto, sm90 = tmp_path / "k3v4.yaml", tmp_path / "k3v4-sm90.yaml"
    auto.write_text(GOOD_YAML)
    sm90.write_text(SM90_YAML + "name: k3v4\n")
    out = tmp_path / "out"
    result = tqgen("build", auto, sm90, auto, "-o", out)
    assert result.returncode == 0, result.stderr
    assert {p.name for p in out.iterdir()} == built_names(K3V4)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(out))
    check = subprocess.run([sys.executable, "-c", f"import {dispatcher_name(K3V4)[:-3]} as tq; tq.variant_for()"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr[-2000:]


def test_unwritable_output_fails_with_one_line(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    stderr = assert_one_line_error(tqgen("build", K3V4, "-o", blocker))
    assert f"the folder {blocker} cannot be written: it is a file" in stderr


def test_a_folder_where_a_module_goes_fails_with_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    blocker = out / variant_name(K3V4, "sm90")
    blocker.mkdir(parents=True)
    stderr = assert_one_line_error(tqgen("build", K3V4, "-o", out))
    assert f"the folder {out} cannot be written: {blocker} cannot be created (Is a directory)" in stderr
    assert [p.name for p in out.iterdir()] == [blocker.name] and blocker.is_dir()


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize("folder, why", [("/proc/forbidden", "it cannot be created"),
                                         ("/proc", f"/proc/{variant_name(K3V4, 'sm80')} cannot be created")])
def test_output_folder_that_takes_no_files_fails_with_one_line(folder, why):
    # /proc takes no new folders or files, even from root, and answers "No such file or directory",
    # which names the wrong thing.
    stderr = assert_one_line_error(tqgen("build", K3V4, "-o", folder))
    assert f"the folder {folder} cannot be written: {why} (the file system does not allow it)" in stderr
    assert "No such file" not in stderr


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_output_folder_fails_with_one_line(tmp_path):
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        stderr = assert_one_line_error(tqgen("build", K3V4, "-o", folder))
    finally:
        folder.chmod(0o700)
    assert f"the folder {folder} cannot be written" in stderr and "Permission denied" in stderr
    assert folder_is_empty(folder)


@pytest.mark.parametrize("command", ["show", "render"])
def test_show_and_render_refuse_a_bad_config_with_one_line(tmp_path, command):
    bad = tmp_path / "bad.yaml"
    bad.write_text(GOOD_YAML.replace("head_dim: 128", "head_dim: 100"))
    result = tqgen(command, bad)
    stderr = assert_one_line_error(result)
    assert "head_dim" in stderr and "100" in stderr
    assert result.stdout == ""


@pytest.mark.parametrize(
    "args, phrase",
    [
        pytest.param(["frobnicate"], "frobnicate", id="unknown-subcommand"),
        pytest.param(["build"], "CONFIG", id="build-without-config"),
        pytest.param([], "COMMAND", id="no-subcommand"),
        pytest.param(["show", K3V4, "--bogus"], "--bogus", id="unknown-option"),
    ],
)
def test_bad_usage_fails_with_one_line(args, phrase):
    result = tqgen(*args)
    stderr = assert_one_line_error(result)
    assert phrase in stderr


# --------------------------------------------------------------------------
# show, render
# --------------------------------------------------------------------------
def test_show_prints_slot_size_and_artifact_name():
    result = tqgen("show", K3V4)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert "118 bytes" in result.stdout
    # arch auto: what build writes, whatever this machine has: the dispatcher, each variant, each one's tuning.
    assert f"artifact    {dispatcher_name(K3V4)}:" in result.stdout
    assert config_mod.load(REPO / K3V4).hash() in result.stdout
    assert render_mod.template_hash() in result.stdout
    sm90 = dataclasses.replace(config_mod.load(REPO / K3V4), arch="sm90")
    buckets = len(tuned_files.baked_launches(REPO / "tuned", sm90, print)[SHIPPED_DEVICE]["buckets"])
    shown = result.stdout.split("\nvariant     ")[1:]
    assert [block.split(":")[0] for block in shown] == list(config_mod.KNOWN_ARCHES)
    for arch, block in zip(config_mod.KNOWN_ARCHES, shown):
        variant = dataclasses.replace(config_mod.load(REPO / K3V4), arch=arch)
        assert block.startswith(f"{arch}: {variant_name(K3V4, arch)}, decode {render_mod.decode_kernel_hash(variant)}")
        assert (f"  tuned       {SHIPPED_DEVICE}: {buckets} buckets" in block) == (arch == "sm90"), block
        assert ("  tuned       none" in block) == (arch != "sm90")


def test_show_of_an_explicit_arch_shows_that_module(tmp_path):
    config = tmp_path / "k3v4-sm80.yaml"
    config.write_text(GOOD_YAML + "arch: sm80\n")
    result = tqgen("show", config)
    assert result.returncode == 0, result.stderr
    assert f"artifact    {config_mod.load(config).artifact_name()}.py\n" in result.stdout
    assert "variant " not in result.stdout
    assert "tuned       none for sm80" in result.stdout and f"{SHIPPED.parent.name}/{SHIPPED.name}" \
        in result.stdout  # the arch that has launches is named


def test_render_prints_a_module_that_compiles():
    result = tqgen("render", K8V4)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("# Generated by tqgen")
    compile(result.stdout, "<rendered>", "exec")
    expected = render_mod.render(dataclasses.replace(config_mod.load(REPO / K8V4), arch="sm80"))
    assert result.stdout == expected


def test_verify_on_the_cpu_passes_and_reports_each_check(tmp_path):
    result = tqgen("verify", "configs/k3v3-d128.yaml", "--device", "cpu", "--cache-dir", tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == "all checks passed"
    checks = [line.split()[0] for line in lines if line.startswith("  ")]
    assert checks and set(checks) == {"ok"} and len(checks) == 7


@pytest.mark.parametrize("interpret", ["1", None], ids=["interpreter", "no-gpu"])
def test_verify_on_cuda_without_a_gpu_fails_with_one_line(tmp_path, interpret):
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    if interpret is None:
        env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU, whatever the machine has
    else:
        env["TRITON_INTERPRET"] = interpret
    result = subprocess.run([sys.executable, "-m", "tqgen.cli", "verify", K3V4, "--device", "cuda", "--cache-dir",
                             tmp_path], cwd=REPO, env=dict(env, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                            timeout=120)
    stderr = assert_one_line_error(result)
    assert "--device cuda" in stderr and "--device cpu" in stderr
    assert ("unset TRITON_INTERPRET" if interpret else "needs a CUDA GPU") in stderr
    assert result.stdout == "" and folder_is_empty(tmp_path)


@pytest.mark.parametrize("seed", [str(2**64), str(-2**63 - 1)])
def test_verify_refuses_a_seed_out_of_range_with_one_line(tmp_path, seed):
    """torch's generators take a 64-bit seed: a larger one raised a traceback once the module was built."""
    result = tqgen("verify", K3V4, "--device", "cpu", "--seed", seed, "--cache-dir", tmp_path)
    stderr = assert_one_line_error(result)
    assert f"--seed {seed}" in stderr and result.stdout == "" and folder_is_empty(tmp_path)


def test_bench_without_a_gpu_fails_with_one_line():
    assert "needs a CUDA GPU" in assert_one_line_error(tqgen("bench", K3V4))


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
    # Launches decode refuses (block_kv a power of two >= 32, num_warps one <= 32): baked, every call of the bucket
    # raised LaunchError.
    pytest.param(_first_best("block_kv", 48), id="block-kv-48"),
    pytest.param(_first_best("block_kv", 16), id="block-kv-16"),
    pytest.param(_first_best("num_warps", 3), id="three-warps"),
])
@pytest.mark.parametrize("command", ["build", "show"])
def test_a_damaged_tuned_file_is_reported_and_ignored_by_build_and_show(tmp_path, damage, command):
    document = json.loads(SHIPPED.read_text())
    damage(document)
    tuned = tmp_path / "tuned" / SHIPPED.parent.name
    tuned.mkdir(parents=True)
    (tuned / SHIPPED.name).write_text(json.dumps(document))
    config = tmp_path / "sm90.yaml"
    config.write_text(SM90_YAML)
    extra = ["-o", tmp_path / "out"] if command == "build" else []
    result = tqgen(command, config, "--tuned-dir", tmp_path / "tuned", *extra)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    said = result.stderr + result.stdout
    assert f"tqgen: ignoring {tuned / SHIPPED.name}" in said
    assert "another setup" not in said  # ignored for its damage, not as a stale file
    assert "none" in result.stdout


@pytest.mark.parametrize("option, values", [
    # Shapes that are not positive: a ZeroDivisionError or a negative tensor size once the first bucket is drawn.
    ("--kv-heads", ["0"]), ("--kv-heads", ["-2"]), ("--group-size", ["0"]), ("--group-size", ["-1"]),
    ("--batch", ["0"]), ("--context", ["0"]),
    # Launches decode refuses (num_warps a power of two up to 32, block_kv one of at least 32): every such candidate
    # would be rejected in every bucket, and with no other, every bucket would fail, after the tune.
    ("--warps", ["1", "3"]), ("--warps", ["64"]), ("--block-kv", ["48"]), ("--block-kv", ["16"]),
    # No launch would merge in stage 1: say so rather than time stage 2 alone as if asked.
    ("--merge-max-splits", ["0"]),
    # A shortlist of no launch would time nothing; a table to shortlist from ranks nothing without K, or is not there.
    ("--shortlist", ["0"]), ("--shortlist-from", ["tuned"]),
    ("--shortlist-from", ["no/such/folder", "--shortlist", "4"])])
def test_tune_refuses_bad_shapes_and_launches_with_one_line_before_tuning(tmp_path, monkeypatch, capsys, option,
                                                                         values):
    from tqgen import cli

    # As on a GPU, but nothing may be tuned: the check comes first.
    monkeypatch.setattr(cli, "_cuda_available", lambda: True)
    monkeypatch.setattr(tuned_files, "device_fingerprint", lambda: FINGERPRINT)
    monkeypatch.setattr(tuner, "tune", lambda *a, **k: pytest.fail("tuned with a bad option"))
    config = tmp_path / "k3v4.yaml"
    config.write_text("key_format: mse\nkey_bits: 3\nvalue_bits: 4\nhead_dim: 64\n")
    status = cli.main(["tune", str(config), "--tuned-dir", str(tmp_path / "tuned"), "--cache-dir", str(tmp_path / "c"),
                       "--batch", "1", "--context", "100", "--compile-workers", "1", option, *values])
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


@pytest.mark.parametrize("where", ["under-a-file", "proc", "new-folder"])
def test_bench_chart_folder_is_made_or_refused_before_timing(tmp_path, monkeypatch, capsys, where):
    """--chart's folder, like --json's, is made before anything is timed, or refused in one line: the chart is drawn
    after every timing, where a missing folder failed (and one that cannot be made lost the chart of the run)."""
    from tqgen import bench, cli
    from tqgen.errors import TqgenError

    monkeypatch.setattr(cli, "_cuda_available", lambda: True)
    monkeypatch.setattr(bench, "copy_ceiling_gbps", lambda: pytest.fail("timed before the chart's folder was made"))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    if where == "proc" and not Path("/proc/self").is_dir():
        pytest.skip("needs Linux's /proc")
    target = {"under-a-file": blocker / "chart.png", "proc": Path("/proc/tqgen/chart.png"),
              "new-folder": tmp_path / "new" / "chart.png"}[where]
    if where == "new-folder":  # made, then the timing starts
        monkeypatch.setattr(bench, "copy_ceiling_gbps", lambda: (_ for _ in ()).throw(TqgenError("stop here")))
    status = cli.main(["bench", str(REPO / K3V4), "--cache-dir", str(tmp_path / "c"), "--chart", str(target)])
    stderr = capsys.readouterr().err
    assert status == 2 and stderr.count("\n") == 1, stderr
    if where == "new-folder":
        assert "stop here" in stderr and target.parent.is_dir()
    else:
        assert stderr.startswith("tqgen: error: ") and str(target.parent) in stderr, stderr


@pytest.mark.parametrize("options", [["--q-heads", "12"], ["--kv-heads", "0"], ["--q-heads", "-8"],
                                     ["--batch", "0", "--context", "1024"], ["--batch", "1", "--context", "-1"],
                                     ["--store-tokens", "32", "0"], ["--store-tokens", "-4096"]])
def test_bench_refuses_bad_heads_and_shapes_with_one_line_before_timing(monkeypatch, capsys, options):
    from tqgen import bench, cli

    # As on a GPU, but nothing may be timed: the checks come first.
    monkeypatch.setattr(cli, "_cuda_available", lambda: True)
    monkeypatch.setattr(bench, "copy_ceiling_gbps", lambda: pytest.fail("timed with a bad option"))
    status = cli.main(["bench", str(REPO / K3V4), *options])
    stderr = capsys.readouterr().err
    assert status == 2 and stderr.startswith("tqgen: error: bench: ") and stderr.count("\n") == 1, stderr
    assert options[0] in stderr


def test_bench_json_records_the_command_and_each_config(tmp_path, monkeypatch):
    # The JSON alone rebuilds BENCHMARKS.md's tables and says how to re-run them: the command line, the TQGEN_
    # settings and each config's resolved fields (its cache layout, which a config's cosmetic name need not say).
    import json
    import shlex

    from tqgen import bench, cli

    monkeypatch.setattr(cli, "_cuda_available", lambda: True)
    monkeypatch.setattr(bench, "copy_ceiling_gbps", lambda: 1000.0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Test GPU")
    monkeypatch.setattr(bench, "bench_store", lambda module, config, tokens, **k: bench.OpRow(
        config=config.name, op="store", shape=f"{tokens} tokens", graph_us=1.0, nbytes=1, gbps=1.0, ceiling_pct=0.1))
    monkeypatch.setenv("TQGEN_BENCH_TEST_SETTING", "1")
    target = tmp_path / "bench.json"
    argv = ["bench", str(REPO / "configs/k3v4-d128-planes.yaml"), "--ops", "store", "--store-tokens", "32",
            "--cache-dir", str(tmp_path / "c"), "--json", str(target)]
    assert cli.main(argv) == 0
    metadata = json.loads(target.read_text())["metadata"]
    assert metadata["command"] == shlex.join(["tqgen", *argv])
    assert metadata["environment"]["TQGEN_BENCH_TEST_SETTING"] == "1"
    assert metadata["configs"]["k3v4-d128-planes"]["cache_layout"] == "planes"
    assert metadata["configs"]["k3v4-d128-planes"]["head_dim"] == 128


# --------------------------------------------------------------------------
# chart
# --------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["under-a-file", "missing-folder"])
def test_chart_to_a_folder_that_is_not_there_fails_with_one_line_naming_it(tmp_path, where):
    """A PNG under a file raised a traceback (cleaning up its partial file), and one in a missing folder was
    refused as 'the file system does not allow it', which names the wrong thing."""
    pytest.importorskip("matplotlib")
    bench_json = tmp_path / "bench.json"
    bench_json.write_text(json.dumps({"metadata": {}, "copy_ceiling_gbps": 1000.0,
                                      "rows": [{"config": "k3v4", "batch": 1, "context": 1024, "gbps": 500.0}]}))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    folder = blocker if where == "under-a-file" else tmp_path / "missing"
    stderr = assert_one_line_error(tqgen("chart", bench_json, folder / "chart.png"))
    assert f"cannot write the chart to {folder / 'chart.png'}: the folder {folder} " in stderr
    assert ("is a file" if where == "under-a-file" else "does not exist") in stderr
    assert "file system does not allow" not in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "bench.json"]


@pytest.mark.parametrize("kind", ["missing", "a-file", "env-missing"])
@pytest.mark.parametrize("command", ["build", "show"])
def test_a_tuned_dir_that_is_not_a_folder_fails_with_one_line_before_writing(tmp_path, command, kind):
    """A mistyped --tuned-dir (or $TQGEN_TUNED_DIR) built every module with the heuristic launches alone, and said
    only 'tuned launches: none (heuristic)', as for a config that was never tuned."""
    tuned = tmp_path / ("tuned.json" if kind == "a-file" else "no-such-tuned")
    if kind == "a-file":
        tuned.write_text("{}")
    out = tmp_path / "out"
    args = [command, REPO / K3V4] + (["-o", out] if command == "build" else [])
    if kind == "env-missing":
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO), TQGEN_TUNED_DIR=str(tuned))
        result = subprocess.run([sys.executable, "-m", "tqgen.cli", *map(str, args)], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=120)
    else:
        result = tqgen(*args, "--tuned-dir", tuned)
    stderr = assert_one_line_error(result)
    named = "$TQGEN_TUNED_DIR" if kind == "env-missing" else "--tuned-dir"
    assert f"{named} {tuned}: " in stderr
    assert ("is a file, not a folder" if kind == "a-file" else "no such folder") in stderr
    assert result.stdout == "" and not out.exists()
