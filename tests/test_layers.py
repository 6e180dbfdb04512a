"""The package's layers (DEVELOPERS: kernels know nothing of transformers, the glue is thin,
distributed code is its own layer, benchmarks are imported by nothing else) and no import cycle
among its modules, counting imports inside functions too (issue 33, item 2). Read from the
source with `ast`, so an import that only runs on some path is seen as well."""
from __future__ import annotations

import ast
from pathlib import Path

import hf_dilated

PACKAGE = Path(hf_dilated.__file__).parent
# patches/ and model_configs/ install inside hf_dilated's namespace (pyproject.toml)
ROOTS = {"hf_dilated": PACKAGE, "hf_dilated.patches": PACKAGE.parent / "patches",
         "hf_dilated.model_configs": PACKAGE.parent / "model_configs"}


def _modules() -> dict[str, Path]:
    out = {}
    for prefix, root in ROOTS.items():
        for path in root.rglob("*.py"):
            if any(part in ("patches", "model_configs") for part in path.relative_to(root).parts[:-1]) \
                    and prefix == "hf_dilated":
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([prefix, *parts])] = path
    return out


MODULES = _modules()


def _resolve(name: str, module: str, is_package: bool, level: int) -> str:
    if level == 0:
        return name.replace("patches", "hf_dilated.patches", 1) if name.startswith("patches") else name
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _imports(module: str) -> set[str]:
    """The package's modules `module` imports: `from .a import b` counts as importing a.b when
    a.b is a module, else a (a package's __init__ run on the way to a submodule is not counted,
    as pylint's cyclic-import check does not)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module or "", module, path.name == "__init__.py", node.level)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        out.update(n for n in names if n in MODULES and n != module)
    return out


GRAPH = {module: _imports(module) for module in MODULES}


def _cycle() -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(GRAPH):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_graph_is_read():
    assert "hf_dilated.ops.head_groups" in GRAPH["hf_dilated.ops.dilated"]
    assert "hf_dilated.checks" in GRAPH["hf_dilated.ops.block_patterns"]
    assert "hf_dilated.ops.block_patterns" in GRAPH["hf_dilated.config"]  # inside a function


def test_no_import_cycle():
    assert _cycle() is None, " -> ".join(_cycle())


def _sources(prefix):
    return [m for m in GRAPH if m == prefix or m.startswith(prefix + ".")]


def test_kernels_import_nothing_of_transformers_nor_of_the_other_layers():
    for module in _sources("hf_dilated.ops"):
        text = MODULES[module].read_text()
        assert "transformers" not in {n.split(".")[0] for n in _third_party(module)}, module
        for target in GRAPH[module]:
            assert not target.startswith(("hf_dilated.integrations", "hf_dilated.distributed", "hf_dilated.bench",
                                          "hf_dilated.kinds", "hf_dilated.nn")), (module, target, len(text))


def test_nothing_imports_the_benchmarks_but_themselves_and_the_command_line():
    for module, targets in GRAPH.items():
        if module.startswith("hf_dilated.bench") or module == "hf_dilated.cli":
            continue
        assert not any(t.startswith("hf_dilated.bench") for t in targets), module


def _third_party(module) -> set[str]:
    tree = ast.parse(MODULES[module].read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out
