"""The package as users get it: a non-editable wheel, and the README's example."""

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_carries_the_templates_and_renders_outside_the_checkout(tmp_path):
    pytest.importorskip("hatchling", reason="the wheel is built without build isolation (pip install -e '.[test]')")
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                    str(ROOT)], check=True, capture_output=True)
    (wheel,) = dist.glob("tqgen-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    templates = sorted(p.relative_to(ROOT / "templates").as_posix() for p in (ROOT / "templates").rglob("*.jinja"))
    assert len(templates) > 10
    for template in templates:
        assert f"tqgen/_templates/{template}" in names
    # Tuning data only: tuned/<device>/<artifact>.json and the folder's README, no benchmark outputs.
    tuned = [name for name in names if name.startswith("tqgen/_tuned/")]
    assert tuned and all(name.endswith(".json") and "/tq_" in name or name.endswith("README.md") for name in tuned), tuned
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    script = ("import tqgen.config as c, tqgen.render as r; print(r.template_dir()); "
              "cfg = c.resolve_arch(c.from_mapping(dict(key_format='mse', key_bits=3, value_bits=4, head_dim=128)), (9, 0)); "
              "print(len(r.render(cfg)))")
    env = dict(os.environ, PYTHONPATH=str(site))
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                            check=True)
    template_dir, length = result.stdout.split()
    assert Path(template_dir) == site / "tqgen" / "_templates"
    assert int(length) > 10_000


def _readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Using the emitted module"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_example_runs(monkeypatch, tmp_path):
    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("TQGEN_CACHE_DIR", str(tmp_path))
    namespace = {}
    exec(compile(_readme_example().replace('"cuda"', repr(device)), "README.md", "exec"), namespace)
    out, keys, values = namespace["out"], namespace["keys"], namespace["values"]
    assert out.shape == (2, 32, 128) and out.dtype == torch.float16
    assert torch.all(out[1] == 0) and torch.isfinite(out).all() and not torch.all(out[0] == 0)
    assert keys.shape == values.shape == (2, 8, 20, 128)
    # The stored keys come back close to what was written (3-bit keys: relative error about 0.2).
    original = namespace["key"].float().transpose(0, 1)
    assert ((keys[0].float() - original).norm() / original.norm()) < 0.3
    assert list(tmp_path.glob("tq_kmse3_v4_d128_*.py"))


def test_readme_decode_multi_example_runs(monkeypatch, tmp_path):
    """The speculative-decoding example, run after the first one as the README reads (its cache and block table),
    with decode_multi's default validate=True."""
    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Several query tokens per sequence"):]
    program = _readme_example() + re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("TQGEN_CACHE_DIR", str(tmp_path))
    namespace = {}
    exec(compile(program.replace('"cuda"', repr(device)), "README.md", "exec"), namespace)
    assert namespace["out"].shape == (2, 3, 32, 128) and torch.isfinite(namespace["out"]).all()


def test_readme_build_example_loads_what_a_build_here_writes(monkeypatch, tmp_path, capsys):
    """The Quick start's `tqgen build`, run on this machine (no GPU needed), writes the files that the
    README's examples load: the dispatcher, named without an arch."""
    from tqgen import cli

    text = (ROOT / "README.md").read_text()
    command = re.search(r"```bash\n(.*?)\n```", text[text.index("## Quick start"):], re.S).group(1)
    build = command[command.index("tqgen build "):].split()
    monkeypatch.chdir(tmp_path)
    assert cli.main([str(ROOT / arg) if arg.endswith(".yaml") else arg for arg in build[1:]]) == 0
    named = set(re.findall(r"build/(tq_\w+)\.py", text)) | set(re.findall(r"import (tq_\w+) as tq", text))
    assert named and all((tmp_path / "build" / f"{name}.py").is_file() for name in named), named
    section = text[text.index("### Building once, running anywhere"):text.index("### Without a GPU")]
    program = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    monkeypatch.setattr(sys, "path", list(sys.path))  # the example's sys.path.insert, undone after the test
    for name in named:
        monkeypatch.delitem(sys.modules, name, raising=False)
    capsys.readouterr()
    exec(compile(program.replace('"cuda"', repr(device)), "README.md", "exec"), {})
    printed = capsys.readouterr().out
    from tqgen import config as config_mod

    config = config_mod.load(ROOT / "configs" / "k3v4-d128-planes.yaml")
    arch = "sm80" if device == "cpu" else config_mod.resolve_arch(config, torch.cuda.get_device_capability()).arch
    assert printed == f"{arch} {sorted(config_mod.KNOWN_ARCHES)}\n"
    for name in named:  # imported by the example: gone with it
        sys.modules.pop(name, None)


def test_readme_cpu_example_runs_as_the_readme_says(tmp_path):
    """The section's CPU program, saved as the README names it and run with the README's command from the
    repository's root: TRITON_INTERPRET=1 set in the environment before Python starts, nowhere else."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Without a GPU"):text.index("### The API")]
    command = re.search(r"```bash\n(.*?)\n```", section, re.S).group(1)
    program = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert command == "TRITON_INTERPRET=1 python cpu_example.py"
    assert "TRITON_INTERPRET" not in program and '"cuda"' not in program
    (tmp_path / "cpu_example.py").write_text(program)
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env.update(TRITON_INTERPRET="1", TQGEN_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, str(tmp_path / "cpu_example.py")], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "(2, 32, 128) (2, 8, 20, 128)\n"
