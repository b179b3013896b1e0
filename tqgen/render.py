"""Render the Jinja templates into one specialized Python module's source.

The templates (templates/, one folder per op plus shared/) read the config's
`Plan` and nothing else: layout facts, named constants and per-arch decisions.
Only what the config needs is rendered: no branches for other formats, the fp8
decode chosen for the arch. Same inputs, byte-identical output: nothing
machine- or time-dependent enters.

Tuned launches are keyed on `decode_kernel_hash`: a hash of the code that the
tuner times, found in the rendered module itself (every definition that the
decode launch reaches), with comments, docstrings and formatting left out.
"""

from __future__ import annotations

import ast
import copy
import functools
import hashlib
import inspect
import json
import pprint
import re
import textwrap
from pathlib import Path

import jinja2

from . import __version__, buckets, codebook
from .config import Config
from .plan import Plan

MODULE_TEMPLATE = "module.py.jinja"
DISPATCHER_TEMPLATE = "dispatcher.py.jinja"  # an arch-auto build's dispatcher (tqgen/dispatch.py)
# The decode launcher that the tuner times: it runs the kernels with a chosen launch. Launch
# selection (the tuned table, the heuristic) sits above it and is not part of the hash.
DECODE_ENTRY = "_run_decode"
MAX_LINE = 120


def template_dir() -> Path:
    """templates/ of a checkout, or the copy packaged into an installed wheel."""
    package = Path(__file__).resolve().parent
    for candidate in (package / "_templates", package.parent / "templates"):
        if (candidate / MODULE_TEMPLATE).is_file():
            return candidate
    raise FileNotFoundError(f"tqgen templates not found next to {package}")


def template_hash() -> str:
    """SHA-256 over the path and bytes of every template a module is rendered from (recorded for
    information: the tuning is keyed on decode_kernel_hash). The dispatcher's template is left out: it
    renders no kernel, and an arch-auto dispatcher records the SHA-256 of each module it loads."""
    digest = hashlib.sha256()
    root = template_dir()
    for path in sorted(root.rglob("*.jinja")):
        if path.relative_to(root).as_posix() == DISPATCHER_TEMPLATE:
            continue
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _environment() -> jinja2.Environment:
    return _environment_of(str(template_dir()))


@functools.cache
def _environment_of(folder: str) -> jinja2.Environment:
    """One environment a template folder and process: it compiles each template once (a module's render loads about
    25 of them, and compiling them took most of a build) and again only when its file changes (auto_reload)."""
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(folder),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def _embedded_sources(module) -> list[str]:
    return [inspect.getsource(getattr(module, name)).rstrip() for name in module.EMBEDDED]


def _tuned_literal(tuned: dict) -> str:
    """The baked table as a readable, deterministic Python literal."""
    if not tuned:
        return "{}"
    lines = ["{"]
    for device in sorted(tuned):
        entry = tuned[device]
        lines.append(f"    {device!r}: {{")
        lines.append(f"        'triton_version': {entry['triton_version']!r},")
        lines.append(f"        'source': {entry['source']!r},")
        if "kv_heads" in entry:
            lines.append(f"        'kv_heads': {entry['kv_heads']!r},")
        lines.append("        'buckets': {")
        for key in sorted(entry["buckets"], key=buckets.bucket_sort_key):
            lines.append(f"            {key!r}: {tuple(entry['buckets'][key])!r},")
        lines.append("        },")
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines)


def _tuning_summary(tuned: dict) -> str:
    if not tuned:
        return "none; launches come from the heuristic in `decode_launch_defaults` unless passed."
    parts = [f"{device}: {len(entry['buckets'])} buckets from {entry['source']}" for device, entry in sorted(tuned.items())]
    text = "; ".join(parts) + "; other shapes and devices use `decode_launch_defaults`."
    # Wrapped as the docstring's "Tuning: " line shows it: each device's tuned file makes the line long.
    prefix = "Tuning: "
    return textwrap.fill(text, MAX_LINE, initial_indent=prefix, subsequent_indent="    ", break_long_words=False,
                         break_on_hyphens=False)[len(prefix):]


def context(config: Config, tuned: dict | None = None, stage1_variant: str = "shipped") -> dict:
    """Everything the templates may read: the plan's names, and what the module records about its build."""
    plan = Plan.from_config(config, stage1_variant)
    return {
        **plan.template_names(),
        "version": __version__,
        "config_items": [(k, json.dumps(v)) for k, v in config.to_dict().items() if v is not None],
        "config_literal": pprint.pformat(config.to_dict(), width=100, sort_dicts=True),
        "config_hash": config.hash(),
        "template_hash": template_hash(),
        "embedded_sources": _embedded_sources(codebook),
        "bucket_sources": _embedded_sources(buckets),
        "tuned_literal": _tuned_literal(tuned or {}),
        "tuning_summary": _tuning_summary(tuned or {}),
        "output_dtype_literal": "None" if config.output_dtype == "auto" else f"torch.{config.output_dtype}",
    }


def _tidy(source: str) -> str:
    """PEP 8 spacing whatever the templates' whitespace: no trailing spaces, two
    blank lines before each top-level definition, never more than two in a row."""
    out: list[str] = []
    for line in source.splitlines():
        line = line.rstrip()
        top_level = line.startswith(("@", "def ", "class "))
        if top_level and out and not out[-1].startswith(("@", "#")):
            while out and out[-1] == "":
                out.pop()
            out.extend(["", ""])
        out.append(line)
    text = "\n".join(out).strip("\n") + "\n"
    return re.sub(r"\n{4,}", "\n\n\n", text)


def render(config: Config, tuned: dict | None = None, stage1_variant: str = "shipped") -> str:
    """The complete source of the module for one config.

    `tuned` maps a device name to {"triton_version", "source", "kv_heads" (the KV heads its buckets were timed
    over), "buckets": {bucket key: (block_kv, num_warps, num_stages, num_splits, ...)}} (see
    tuned_files.baked_launches).
    `stage1_variant` renders an experiment of the Gluon stage 1 instead of the shipped kernel (plan.py).
    """
    source = _environment().get_template(MODULE_TEMPLATE).render(**context(config, tuned, stage1_variant))
    source = _tidy(source)
    compile(source, f"<{config.artifact_name()}>", "exec")  # a template bug fails here, not at import
    return source


# --- the decode hash --------------------------------------------------------------
def _definitions(tree: ast.Module) -> dict[str, list[ast.stmt]]:
    """Module-level definitions by name (functions, classes, assignments, imports), those under a
    top-level `if` included (the Gluon kernels sit under `if _GLUON:`)."""
    found: dict[str, list[ast.stmt]] = {}

    def visit(statements):
        for node in statements:
            if isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
                continue
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name)]
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [(alias.asname or alias.name).split(".")[0] for alias in node.names]
            else:
                continue
            for name in names:
                found.setdefault(name, []).append(node)

    visit(tree.body)
    return found


def _without_docstrings(node: ast.stmt) -> ast.stmt:
    """A copy of a definition with every docstring removed (comments never reach the AST)."""
    node = copy.deepcopy(node)
    for inner in ast.walk(node):
        if isinstance(inner, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            body = inner.body
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                    and isinstance(body[0].value.value, str):
                inner.body = body[1:] or [ast.Pass()]
    return node


def _canonical(node) -> str:
    """A syntax tree as text that is the same on every Python version tqgen supports: node types and
    the fields that hold something (ast.dump shows fields that are empty on some versions only, such
    as 3.12's type_params, and 3.13 leaves empty ones out)."""
    if isinstance(node, ast.AST):
        fields = [f"{name}={_canonical(value)}" for name, value in ast.iter_fields(node)
                  if value not in (None, []) and name not in ("ctx", "type_comment", "kind")]
        return f"{type(node).__name__}({','.join(fields)})"
    if isinstance(node, list):
        return "[" + ",".join(_canonical(item) for item in node) + "]"
    return repr(node)


def decode_path(source: str, entry: str = DECODE_ENTRY) -> list[str]:
    """The names of every module-level definition that `entry` reaches in a rendered module, sorted."""
    return _reached(_definitions(ast.parse(source)), entry)


def _reached(definitions: dict[str, list[ast.stmt]], entry: str) -> list[str]:
    if entry not in definitions:
        raise ValueError(f"the rendered module defines no {entry}")
    reached, pending = set(), [entry]
    while pending:
        name = pending.pop()
        if name in reached or name not in definitions:
            continue
        reached.add(name)
        for node in definitions[name]:
            pending += [inner.id for inner in ast.walk(node) if isinstance(inner, ast.Name)]
    return sorted(reached)


def decode_kernel_hash(config: Config) -> str:
    """SHA-256 of the decode path of one config's module as the tuner times it: every definition
    that `_run_decode` reaches (the kernels, the helpers they call, the constants they read, the
    launch code), each without comments, docstrings or formatting.

    Tuned launches are keyed on this rather than on `template_hash`: an edit to the store or
    dequantize kernels, the launch heuristic, a comment or a docstring keeps the tuning; any change
    to code that the tuner timed, for this config and arch, drops it.
    """
    definitions = _definitions(ast.parse(render(config)))
    digest = hashlib.sha256()
    for name in _reached(definitions, DECODE_ENTRY):
        for node in definitions[name]:
            digest.update(name.encode() + b"\0" + _canonical(_without_docstrings(node)).encode() + b"\0")
    return digest.hexdigest()
