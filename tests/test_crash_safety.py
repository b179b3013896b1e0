"""Module files survive failed writes, killed writers and concurrent builds.

`files.write_atomic` writes a temp file in the target's folder, fsyncs it and
renames it over the target, so a reader only ever sees the old file or the
new one. Checked here with failures injected in the write (monkeypatched),
with real writer processes killed by SIGKILL at random moments, and with
several `tqgen build` processes writing the same modules at once.
"""

import errno
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tqgen import emit, files
from tqgen.config import KNOWN_ARCHES
from tqgen.errors import TqgenError

REPO = Path(__file__).resolve().parent.parent
CONFIGS = [REPO / "configs" / "k3v4-d128.yaml", REPO / "configs" / "k8v4-d128.yaml"]
OLD, NEW = b"# old module\nVALUE = 1\n", b"# new module\nVALUE = 2\n" + b"x = 0\n" * 20_000


def child_env():
    return dict(os.environ, PYTHONPATH=str(REPO), TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")


def stray_files(folder: Path, keep) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name not in keep)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The module sources of two shipped configs, as a build for this machine's arch writes them (tqgen.load)."""
    folder = tmp_path_factory.mktemp("sources")
    return [emit.build(emit.as_config(path), folder).read_bytes() for path in CONFIGS]


# --------------------------------------------------------------------------
# A write that fails half way
# --------------------------------------------------------------------------
class _HalfWriter:
    """A file object whose write() writes half of the data, then fails like a full disk."""

    def __init__(self, handle):
        self._handle = handle

    def write(self, data):
        self._handle.write(data[: len(data) // 2])
        self._handle.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self._handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._handle.close()


def _fail(exc):
    def raiser(*args, **kwargs):
        raise exc
    return raiser


def _half_write(monkeypatch):
    real_fdopen = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda *a, **k: _HalfWriter(real_fdopen(*a, **k)))


FAILURES = {
    "replace_fails": lambda mp: mp.setattr(os, "replace", _fail(OSError(errno.EXDEV, "Invalid cross-device link"))),
    "write_fails_half_way": _half_write,
    "fsync_fails": lambda mp: mp.setattr(os, "fsync", _fail(OSError(errno.EIO, "Input/output error"))),
    "chmod_fails": lambda mp: mp.setattr(os, "chmod", _fail(PermissionError(errno.EPERM, "Operation not permitted"))),
    "interrupted_in_replace": lambda mp: mp.setattr(os, "replace", _fail(KeyboardInterrupt())),
}


@pytest.mark.parametrize("failure", list(FAILURES))
def test_failed_write_keeps_the_old_file_and_leaves_no_temp_files(tmp_path, monkeypatch, failure):
    target = tmp_path / "tq_module.py"
    target.write_bytes(OLD)
    before = target.stat()
    FAILURES[failure](monkeypatch)
    with pytest.raises(BaseException) as caught:
        files.write_atomic(target, NEW)
    monkeypatch.undo()
    assert isinstance(caught.value, (OSError, KeyboardInterrupt))
    assert target.read_bytes() == OLD
    assert target.stat().st_mtime_ns == before.st_mtime_ns and target.stat().st_ino == before.st_ino
    assert stray_files(tmp_path, {target.name}) == []
    assert files.write_atomic(target, NEW) and target.read_bytes() == NEW  # and the next write works


@pytest.mark.parametrize("failure", ["replace_fails", "write_fails_half_way"])
def test_failed_write_of_a_new_file_creates_nothing(tmp_path, monkeypatch, failure):
    target = tmp_path / "sub" / "tq_module.py"
    FAILURES[failure](monkeypatch)
    with pytest.raises(OSError):
        files.write_atomic(target, NEW)
    monkeypatch.undo()
    assert not target.exists()
    assert stray_files(target.parent, set()) == []


def test_build_reports_a_failed_write_as_one_line_and_keeps_the_old_module(tmp_path, monkeypatch, sources):
    # One module (an arch-auto build's files together: tests/test_dispatch.py).
    config = emit.as_config(CONFIGS[0])
    path = emit.build(config, tmp_path)
    assert path.read_bytes() == sources[0]
    path.write_bytes(OLD)  # an older module at the same path
    monkeypatch.setattr(os, "replace", _fail(OSError(errno.EROFS, "Read-only file system")))
    with pytest.raises(TqgenError) as caught:
        emit.build(config, tmp_path)
    monkeypatch.undo()
    message = str(caught.value)
    assert "\n" not in message and str(path) in message and "Read-only file system" in message
    assert path.read_bytes() == OLD
    assert stray_files(tmp_path, {path.name}) == []


def test_unchanged_bytes_are_not_rewritten(tmp_path):
    target = tmp_path / "tq_module.py"
    assert files.write_atomic(target, NEW) is True
    inode = target.stat().st_ino
    assert files.write_atomic(target, NEW) is False
    assert target.stat().st_ino == inode and stray_files(tmp_path, {target.name}) == []


# --------------------------------------------------------------------------
# Real writers killed with SIGKILL
# --------------------------------------------------------------------------
WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from tqgen.files import write_atomic
    target, sources = Path(sys.argv[1]), [Path(p).read_bytes() for p in sys.argv[2:]]
    i = 0
    while True:
        write_atomic(target, sources[i % 2])
        i += 1
        if i == 2:
            print("writing", flush=True)
""")


def _start(code, *args):
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], env=child_env(), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_line(child, expected, timeout=60.0):
    """Block until the child prints `expected` (a line), bounded by `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = child.stdout.readline()
        if line.strip() == expected:
            return
        if not line and child.poll() is not None:
            break
    child.kill()
    pytest.fail(f"writer never printed {expected!r}: exit {child.wait()}, {child.stderr.read()[-2000:]}")


def _kill(child):
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    child.stdout.close()
    child.stderr.close()


def test_sigkill_while_writing_never_leaves_a_partial_file(tmp_path, sources):
    """5 writers in turn, each rewriting one path with two alternating modules, killed after 50-300 ms.

    While a writer runs, this process reads the file in a loop: every read sees
    one complete module. After each kill the file is one complete module too.
    """
    source_files = []
    for i, source in enumerate(sources):
        source_files.append(tmp_path / f"source{i}.py")
        source_files[-1].write_bytes(source)
    folder = tmp_path / "out"
    target = folder / "tq_module.py"
    rng = random.Random(1234)
    for _ in range(5):
        child = _start(WRITER, target, *source_files)
        _wait_for_line(child, "writing")
        # Until a random moment of the write loop, read the file as an importer would.
        kill_at = time.monotonic() + rng.uniform(0.05, 0.3)
        reads = 0
        while time.monotonic() < kill_at:
            data = target.read_bytes()
            assert data in sources, f"a reader saw a partial file: {len(data)} bytes"
            reads += 1
        _kill(child)
        assert reads > 0
        data = target.read_bytes()
        assert data in sources, f"partial or foreign file: {len(data)} bytes"
        compile(data, str(target), "exec")
        # A writer killed between mkstemp and rename may leave its temp file; nothing else.
        for name in stray_files(folder, {target.name}):
            assert name.startswith(f".{target.name}.") and name.endswith(".tmp"), name


WRITER_STUCK_IN_FSYNC = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from tqgen import files
    def stuck(fd):
        print("in fsync", flush=True)
        time.sleep(600)
    os.fsync = stuck
    files.write_atomic(Path(sys.argv[1]), Path(sys.argv[2]).read_bytes()[: int(sys.argv[3])])
""")


def test_temp_files_of_a_killed_writer_do_not_break_the_next_build(tmp_path, sources):
    """A writer killed after writing its temp file (stuck in fsync) leaves the temp; the next build works."""
    source = tmp_path / "source.py"
    source.write_bytes(sources[0])
    out = tmp_path / "out"
    config = emit.as_config(CONFIGS[0])  # one module, as tqgen.load builds it
    target = out / f"{config.artifact_name()}.py"
    out.mkdir()
    target.write_bytes(b"# an older module\n")
    child = _start(WRITER_STUCK_IN_FSYNC, target, source, len(sources[0]) // 3)
    _wait_for_line(child, "in fsync")
    _kill(child)
    leftovers = stray_files(out, {target.name})
    assert len(leftovers) == 1 and leftovers[0].startswith(f".{target.name}.")  # the killed writer's temp
    assert target.read_bytes() == b"# an older module\n"
    # Another leftover under the exact name mkstemp could pick next must not matter either.
    (out / f".{target.name}.aaaaaaaa.tmp").write_bytes(sources[1][:100])

    path = emit.build(config, out)
    assert path == target and path.read_bytes() == sources[0]
    module = emit.import_module_file(path)
    assert callable(module.decode) and module.CONFIG_HASH == config.hash()
    assert (out / leftovers[0]).exists()  # the build neither needs nor trips over them


# --------------------------------------------------------------------------
# Concurrent `tqgen build` processes
# --------------------------------------------------------------------------
@pytest.mark.parametrize("writers", [4])
def test_concurrent_builds_of_the_same_configs_agree(tmp_path, writers):
    single = tmp_path / "single"
    for config in CONFIGS:  # arch auto, as the command builds them: a dispatcher and one module per arch each
        emit.build(config, single)
    expected = {path.name: path.read_bytes() for path in single.iterdir()}
    assert len(expected) == len(CONFIGS) * (1 + len(KNOWN_ARCHES))
    shared = tmp_path / "shared"
    for round_ in range(2):  # into an empty folder, then over the same files
        command = [sys.executable, "-m", "tqgen.cli", "build", *map(str, CONFIGS), "-o", str(shared)]
        children = [subprocess.Popen(command, env=child_env(), cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True) for _ in range(writers)]  # started together
        results = [(child.communicate(timeout=120), child.returncode) for child in children]
        for (stdout, stderr), code in results:
            assert code == 0, stderr[-2000:]
            assert "Traceback" not in stderr
        assert sorted(p.name for p in shared.iterdir()) == sorted(expected), f"round {round_}: stray files"
        for name, data in expected.items():
            built = (shared / name).read_bytes()
            assert built == data, f"round {round_}: {name} differs from a single-process build"
            compile(built, name, "exec")


# --------------------------------------------------------------------------
# A module rewritten within the same second
# --------------------------------------------------------------------------
def test_a_rewritten_module_is_imported_as_it_is_now_not_from_a_stale_pyc(tmp_path, monkeypatch):
    """Python's bytecode cache (__pycache__, on by default) trusts a .pyc while the source's size and mtime,
    in whole seconds, match: a module rebuilt within the same second with as many bytes (another tuned
    launch, one digit changed) must still be imported as it is now, the bytes whose hash names it."""
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    path = tmp_path / "tq_module.py"
    stamp = (1_700_000_000, 1_700_000_000)
    for value in (1, 2):
        path.write_text(f"VALUE = {value}\n")
        os.utime(path, stamp)  # the same second as the previous write
        assert emit.import_module_file(path).VALUE == value
