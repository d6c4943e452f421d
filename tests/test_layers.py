"""The package's imports point down the layers (docs/architecture.md): data -> backends -> the
public API -> tools -> the CLI. Every import is read from the source with ast, including imports
inside functions, so a lazy import that points up fails here too."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "flashcl"

# Each module (dotted, relative to flashcl) by the first prefix that matches, most specific first.
LAYERS = (
    ("data", ("_version", "_resources", "errors", "reference", "profiles", "tuning", "quant",
              "variants", "tables")),
    ("backend", ("opencl", "triton")),
    ("api", ("api", "__init__")),
    ("tools", ("tools", "integrations")),
    ("cli", ("cli", "__main__")),
)
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}


def layer_of(module: str) -> str:
    """The layer of ``module`` ("opencl.runtime", "tools.bench", ...)."""
    for name, prefixes in LAYERS:
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return name
    raise AssertionError(f"flashcl.{module} belongs to no layer: add it to LAYERS and docs/architecture.md")


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" and len(rel.parts) > 1 else rel.parts
    return ".".join(parts)


def _imports(path: Path):
    """(line, imported flashcl module) for every import of the package in ``path``."""
    module = _module_name(path)
    package = module.rsplit(".", 1)[0] if "." in module and path.name != "__init__.py" else (
        module if path.name == "__init__.py" and path.parent != PACKAGE else "")
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "flashcl" or alias.name.startswith("flashcl."):
                    yield node.lineno, alias.name[len("flashcl."):] or "__init__"
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if node.module and (node.module == "flashcl" or node.module.startswith("flashcl.")):
                    base = node.module[len("flashcl."):] if node.module != "flashcl" else ""
                else:
                    continue
            else:
                parts = package.split(".") if package else []
                parts = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                target = f"{base}.{alias.name}" if base else alias.name
                yield node.lineno, (target if _exists(target) else base) or "__init__"


def _exists(module: str) -> bool:
    p = PACKAGE.joinpath(*module.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def test_every_module_has_a_layer():
    for path in PACKAGE.rglob("*.py"):
        layer_of(_module_name(path) or "__init__")


def test_imports_point_down():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = _module_name(path) or "__init__"
        for line, target in _imports(path):
            if RANK[layer_of(target)] > RANK[layer_of(me)]:
                upward.append(f"flashcl/{path.relative_to(PACKAGE)}:{line} ({layer_of(me)}) imports "
                              f"flashcl.{target} ({layer_of(target)})")
    assert not upward, "imports that point up the layers:\n" + "\n".join(upward)


def test_backends_do_not_import_each_other():
    crossing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = _module_name(path)
        if layer_of(me or "__init__") != "backend":
            continue
        for line, target in _imports(path):
            if layer_of(target) == "backend" and target.split(".")[0] != me.split(".")[0]:
                crossing.append(f"flashcl/{path.relative_to(PACKAGE)}:{line} imports flashcl.{target}")
    assert not crossing, "\n".join(crossing)


def test_the_walker_sees_lazy_and_relative_imports(tmp_path):
    """The checker itself: an import inside a function, relative at two levels, is found."""
    src = PACKAGE / "opencl" / "probe.py"
    found = {t for _, t in _imports(src)}
    assert "reference" in found          # `from .. import reference` inside a function
    assert "opencl.decode" in found      # `from . import decode, prefill` inside a function
