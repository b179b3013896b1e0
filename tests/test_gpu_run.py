"""What tools/run_gpu.sh relies on from conftest: the suite in shards (TQGEN_TEST_SHARD) and failures logged as they
happen (TQGEN_FAILURE_LOG), so that a device call stopped by its time limit still names what failed."""

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import conftest


class Hook:
    def __init__(self):
        self.deselected = []

    def pytest_deselected(self, items):
        self.deselected.extend(items)


@pytest.mark.parametrize("shard, kept", [("1/3", [0, 3, 6, 9]), ("3/3", [2, 5, 8]), ("1/1", list(range(10)))])
def test_shards_interleave_and_together_hold_every_test_once(monkeypatch, shard, kept):
    monkeypatch.setenv("TQGEN_TEST_SHARD", shard)
    items, hook = list(range(10)), Hook()
    conftest.pytest_collection_modifyitems(types.SimpleNamespace(hook=hook), items)
    assert items == kept and sorted(items + hook.deselected) == list(range(10))


@pytest.mark.parametrize("shard", ["0/2", "3/2", "2", "a/b", "1/0", ""])
def test_a_bad_shard_is_a_usage_error_naming_the_variable(monkeypatch, shard):
    monkeypatch.setenv("TQGEN_TEST_SHARD", shard)
    items = list(range(4))
    if not shard:  # unset or empty: every test runs
        conftest.pytest_collection_modifyitems(types.SimpleNamespace(hook=Hook()), items)
        assert items == list(range(4))
        return
    with pytest.raises(pytest.UsageError, match=f"^TQGEN_TEST_SHARD must be i/n .*, got {shard!r}$"):
        conftest.pytest_collection_modifyitems(types.SimpleNamespace(hook=Hook()), items)


def test_failures_are_logged_by_the_controlling_process_as_they_happen(monkeypatch, tmp_path):
    log = tmp_path / "failures.log"
    monkeypatch.setenv("TQGEN_FAILURE_LOG", str(log))
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)

    def report(nodeid, failed, text="", when="call"):
        return types.SimpleNamespace(nodeid=nodeid, failed=failed, when=when, longreprtext=text)

    conftest.pytest_runtest_logreport(report("tests/a.py::passes", False))
    conftest.pytest_runtest_logreport(report("tests/a.py::fails", True, "trace\nE   assert 3 == 4"))
    conftest.pytest_runtest_logreport(report("tests/a.py::errors", True, "", when="setup"))
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")  # a worker's report reaches the controller, which logs it
    conftest.pytest_runtest_logreport(report("tests/a.py::fails_on_a_worker", True, "E   boom"))
    assert log.read_text().splitlines() == ["tests/a.py::fails [call]: E   assert 3 == 4",
                                            "tests/a.py::errors [setup]: "]


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_a_real_failure_is_logged_once_with_its_message(tmp_path, workers):
    """Through pytest itself (with pytest-xdist's workers too): each failure once, with its exception's message, not
    only the "file:line: AssertionError" that ends its report."""
    if workers:
        pytest.importorskip("xdist")
    (tmp_path / "test_fails.py").write_text("def test_fails():\n    assert 3 == 4, 'three is not four'\n\n\n"
                                            "def test_passes():\n    pass\n")
    log = tmp_path / "failures.log"
    tests = Path(__file__).resolve().parent
    env = {name: value for name, value in os.environ.items()
           if name not in ("PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS", "TQGEN_TEST_SHARD")}
    env.update(TQGEN_FAILURE_LOG=str(log), PYTHONPATH=os.pathsep.join([str(tests), str(tests.parent)]))
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                             *workers, "test_fails.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    assert log.read_text().splitlines() == ["test_fails.py::test_fails [call]: AssertionError: three is not four"]


@pytest.mark.parametrize("test_args,passed", [
    ('tests/test_decode_mma.py -k "slots or captured"', ["tests/test_decode_mma.py", "-k", "slots or captured"]),
    ("", []),
])
def test_test_args_reach_pytest_as_shell_words(tmp_path, test_args, passed):
    """TQGEN_TEST_ARGS is split as a shell would split it: -k "slots or captured" reached pytest as three
    words ('"slots', 'or', 'captured"') and selected nothing. A stand-in python3 records pytest's arguments and runs
    everything else with this interpreter."""
    stand_in = tmp_path / "bin" / "python3"
    stand_in.parent.mkdir()
    record = tmp_path / "pytest-args"
    stand_in.write_text(f'#!/usr/bin/env bash\nif [[ $1 == -m && $2 == pytest ]]; then printf "%s\\n" "${{@:3}}" > '
                        f'"{record}"; exit 0; fi\nexec "{sys.executable}" "$@"\n')
    stand_in.chmod(0o755)
    env = dict(os.environ, PATH=f"{stand_in.parent}{os.pathsep}{os.environ['PATH']}", TQGEN_GPU_STEPS="tests",
               TQGEN_TEST_ARGS=test_args)
    script = Path(__file__).resolve().parent.parent / "tools" / "run_gpu.sh"
    result = subprocess.run(["bash", str(script), str(tmp_path / "out")], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    arguments = record.read_text().splitlines()
    assert arguments[arguments.index("--durations=5") + 1:] == passed


def run_tune_step(tmp_path, stale_lines, stale_status=0, status=0, current=(), file_groups=None, **variables):
    """tools/run_gpu.sh's tune step under a stand-in python3 that says the GPU is an H200 (sm90), answers
    tools/stale_tuned.py with `stale_lines` and exit status `stale_status` (its arguments into stale-call); asked
    about one config's file needing --force, with that config unless `current` names it (a file re-tuned in part); with
    --include-current, each config with its file's group sizes from `file_groups` (none: a config without a file);
    and records each `tqgen.cli tune` call's arguments (one line each); the script must exit with `status`."""
    stand_in = tmp_path / "bin" / "python3"
    stand_in.parent.mkdir(parents=True)
    calls = tmp_path / "tune-calls"
    current_words = " ".join(current)
    groups_of = "".join(f'[[ $config == {config} ]] && groups=" {groups}"; '
                        for config, groups in (file_groups or {}).items())
    stand_in.write_text(
        "#!/usr/bin/env bash\n"
        'if [[ $1 == -c && $2 == *capability* ]]; then echo "9.0 NVIDIA H200"; exit 0; fi\n'
        'if [[ $1 == -c ]]; then echo "NVIDIA H200"; exit 0; fi\n'
        f'if [[ $1 == tools/stale_tuned.py && $6 == --stale-only ]]; then [[ " {current_words} " == *" $7 "* ]] '
        f'|| echo "$7 4"; exit 0; fi\n'
        'if [[ $1 == tools/stale_tuned.py && $6 == --include-current ]]; then '
        f'for config in "${{@:7}}"; do groups=; {groups_of}echo "$config$groups"; done; exit 0; fi\n'
        f'if [[ $1 == tools/stale_tuned.py ]]; then echo "$*" > "{tmp_path}/stale-call"; printf "{stale_lines}"; '
        f'exit {stale_status}; fi\n'
        f'if [[ $1 == -m && $2 == tqgen.cli && $3 == tune ]]; then echo "${{*:4}}" >> "{calls}"; exit 0; fi\n'
        "exit 3\n")
    stand_in.chmod(0o755)
    env = {name: value for name, value in os.environ.items() if not name.startswith("TQGEN_TUNE_")}
    env.update(PATH=f"{stand_in.parent}{os.pathsep}{os.environ['PATH']}", TQGEN_GPU_STEPS="tune", **variables)
    script = Path(__file__).resolve().parent.parent / "tools" / "run_gpu.sh"
    result = subprocess.run(["bash", str(script), str(tmp_path / "out")], env=env, capture_output=True, text=True,
                            timeout=120, cwd=script.parent.parent)
    assert result.returncode == status, result.stdout + result.stderr
    return result.stdout, calls.read_text().splitlines() if calls.exists() else []


TUNE_FLAGS = "--warps 1 --stages 1 2 --block-kv 32 64 --rotate-query stage1 --merge-max-splits 32 --shortlist 12"


def test_the_tune_step_retunes_the_stale_files_with_their_own_group_sizes(tmp_path):
    _, calls = run_tune_step(tmp_path, "configs/k3v4-d128.yaml 4\\nconfigs/k3v4-d128-planes.yaml 1 4 8 16\\n")
    assert calls == [f"configs/k3v4-d128.yaml {TUNE_FLAGS} --group-size 4 --force",
                     f"configs/k3v4-d128-planes.yaml {TUNE_FLAGS} --group-size 1 4 8 16 --force"]
    # The device's name and capability: files of a GPU of another arch have its arch in their names.
    assert (tmp_path / "stale-call").read_text() == "tools/stale_tuned.py --device NVIDIA H200 --capability 9.0\n"


def test_the_tune_step_shortlists_12_launches_unless_told_otherwise(tmp_path):
    """TQGEN_TUNE_SHORTLIST sets how many of the stale file's fastest launches a bucket re-times; empty: every
    candidate (tqgen tune without --shortlist). TQGEN_TUNE_SHORTLIST_FROM adds --shortlist-from to a shortlist."""
    _, calls = run_tune_step(tmp_path, "configs/k3v4-d128.yaml 4\\n", TQGEN_TUNE_SHORTLIST="6")
    assert calls == [f"configs/k3v4-d128.yaml {TUNE_FLAGS.replace('--shortlist 12', '--shortlist 6')} --group-size 4 "
                     f"--force"]
    _, calls = run_tune_step(tmp_path / "full", "configs/k3v4-d128.yaml 4\\n", TQGEN_TUNE_SHORTLIST="")
    assert calls == [f"configs/k3v4-d128.yaml {TUNE_FLAGS.replace(' --shortlist 12', '')} --group-size 4 --force"]
    # TQGEN_TUNE_SHORTLIST_FROM: another GPU's folder ranks the buckets the stale file lacks (only with a shortlist).
    folder = "docs/tuning-tables/NVIDIA_H200"
    _, calls = run_tune_step(tmp_path / "from", "configs/k3v4-d128.yaml 4\\n", TQGEN_TUNE_SHORTLIST_FROM=folder)
    assert calls == [f"configs/k3v4-d128.yaml {TUNE_FLAGS} --shortlist-from {folder} --group-size 4 --force"]
    _, calls = run_tune_step(tmp_path / "from-full", "configs/k3v4-d128.yaml 4\\n", TQGEN_TUNE_SHORTLIST="",
                             TQGEN_TUNE_SHORTLIST_FROM=folder)
    assert calls == [f"configs/k3v4-d128.yaml {TUNE_FLAGS.replace(' --shortlist 12', '')} --group-size 4 --force"]


def test_the_tune_step_says_so_when_nothing_is_stale(tmp_path):
    out, calls = run_tune_step(tmp_path, "")
    assert calls == [] and "no committed tuned file for NVIDIA H200 is stale" in out


def test_named_configs_and_group_sizes_replace_the_stale_list(tmp_path):
    _, calls = run_tune_step(tmp_path, "configs/k3v4-d128.yaml 4\\n", TQGEN_TUNE_CONFIGS="configs/k8v4-d128.yaml",
                             TQGEN_TUNE_GROUPS="8")
    assert calls == [f"configs/k8v4-d128.yaml {TUNE_FLAGS} --group-size 8 --force"]
    # A config named without TQGEN_TUNE_GROUPS: its file's group sizes, or with no file tqgen tune's default ones.
    _, calls = run_tune_step(tmp_path / "again", "configs/k3v4-d128.yaml 4\\n",
                             TQGEN_TUNE_CONFIGS="configs/k8v4-d128.yaml configs/k3v4-d128-planes.yaml",
                             file_groups={"configs/k8v4-d128.yaml": "4"})
    assert calls == [f"configs/k8v4-d128.yaml {TUNE_FLAGS} --group-size 4 --force",
                     f"configs/k3v4-d128-planes.yaml {TUNE_FLAGS} --force"]


def test_a_config_whose_file_is_current_resumes_without_force(tmp_path):
    """A file a cut-off call left re-tuned in part is current: the next call naming it tunes only the buckets it
    lacks (no --force, which would re-time them all); a stale one is set aside and re-tuned (--force)."""
    _, calls = run_tune_step(tmp_path, "", TQGEN_TUNE_CONFIGS="configs/k8v4-d128.yaml configs/k3v4-d128.yaml",
                             TQGEN_TUNE_GROUPS="4", current=["configs/k8v4-d128.yaml"])
    assert calls == [f"configs/k8v4-d128.yaml {TUNE_FLAGS} --group-size 4",
                     f"configs/k3v4-d128.yaml {TUNE_FLAGS} --group-size 4 --force"]


def test_the_tune_step_fails_when_the_stale_list_does_and_still_retunes_what_it_listed(tmp_path):
    """tools/stale_tuned.py exits 1 over a file it cannot read, after listing the configs it could: those are still
    re-tuned, the step fails, and it never says that every file is current."""
    out, calls = run_tune_step(tmp_path, "configs/k3v4-d128.yaml 4\\n", stale_status=1, status=1)
    assert calls == [f"configs/k3v4-d128.yaml {TUNE_FLAGS} --group-size 4 --force"]
    assert "is current" not in out and "tools/stale_tuned.py failed" in out
    out, calls = run_tune_step(tmp_path / "again", "", stale_status=1, status=1)
    assert calls == [] and "is current" not in out and "tools/stale_tuned.py failed" in out


def test_the_pending_step_times_each_config_shipped_against_pending(tmp_path):
    """tools/run_gpu.sh's pending step under a stand-in python3: each config is built twice, without and with
    TQGEN_PENDING_KERNELS=all (whatever the caller's environment says), copied to names that say which is which, and
    both modules reach tools/ab_modules.py (small and large batches) and, for planes configs, bench_decode_multi;
    then the store of TQGEN_AB_STORE_CONFIGS is timed without, with and again without the pending kernels."""
    stand_in = tmp_path / "bin" / "python3"
    stand_in.parent.mkdir(parents=True)
    calls = tmp_path / "calls"
    stand_in.write_text(
        "#!/usr/bin/env bash\n"
        'if [[ $1 == -c && $2 == *emit.build* ]]; then mkdir -p "$4"; '
        'echo "pending=${TQGEN_PENDING_KERNELS}" > "$4/built.py"; echo "$4/built.py"; exit 0; fi\n'
        'if [[ $1 == -c ]]; then echo "torch, triton, a GPU"; exit 0; fi\n'
        f'if [[ $1 == tools/ab_modules.py || $1 == tools/bench_decode_multi.py ]]; then echo "$*" >> "{calls}"; '
        'echo "| a table row |"; exit 0; fi\n'
        f'if [[ $1 == -m && $2 == tqgen.cli ]]; then echo "pending=$TQGEN_PENDING_KERNELS $*" >> "{calls}"; exit 0; fi\n'
        "exit 3\n")
    stand_in.chmod(0o755)
    modules = tmp_path / "modules"
    env = dict(os.environ, PATH=f"{stand_in.parent}{os.pathsep}{os.environ['PATH']}", TQGEN_GPU_STEPS="pending",
               TQGEN_CACHE_DIR=str(modules), TQGEN_PENDING_KERNELS="all",
               TQGEN_AB_CONFIGS="configs/k3v4-d128-planes.yaml configs/k3v4-d128.yaml",
               TQGEN_AB_STORE_CONFIGS="configs/k4v4-d128.yaml configs/k4v4-d128-planes.yaml")
    script = Path(__file__).resolve().parent.parent / "tools" / "run_gpu.sh"
    result = subprocess.run(["bash", str(script), str(tmp_path / "out")], env=env, capture_output=True, text=True,
                            timeout=120, cwd=script.parent.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    for stem in ("k3v4-d128-planes", "k3v4-d128"):
        assert (modules / f"shipped-{stem}.py").read_text() == "pending=\n"
        assert (modules / f"pending-all-{stem}.py").read_text() == "pending=all\n"
    lines = calls.read_text().splitlines()
    planes = f"{modules}/shipped-k3v4-d128-planes.py {modules}/pending-all-k3v4-d128-planes.py"
    slots = f"{modules}/shipped-k3v4-d128.py {modules}/pending-all-k3v4-d128.py"
    assert [line.split(" --")[0] for line in lines] == [
        f"tools/ab_modules.py configs/k3v4-d128-planes.yaml {planes}",
        f"tools/ab_modules.py configs/k3v4-d128-planes.yaml {planes}",
        f"tools/bench_decode_multi.py configs/k3v4-d128-planes.yaml:{modules}/shipped-k3v4-d128-planes.py "
        f"configs/k3v4-d128-planes.yaml:{modules}/pending-all-k3v4-d128-planes.py",
        f"tools/ab_modules.py configs/k3v4-d128.yaml {slots}",
        f"tools/ab_modules.py configs/k3v4-d128.yaml {slots}",
        *(f"pending={pending} -m tqgen.cli bench configs/k4v4-d128.yaml configs/k4v4-d128-planes.yaml"
          for pending in ("", "all", ""))]
    assert "--rotate-query stage1" in lines[0] and "--shapes 32x8192 8x8192" in lines[1]
    assert "| a table row |" in result.stdout
