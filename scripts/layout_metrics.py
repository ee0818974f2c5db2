"""How the package is laid out, measured from its source (``ast``): import cycles between modules of
``compress/`` (imports inside functions included), modules over 500 lines, functions over 80 lines
(``build_parser``, an argparse table, left out), the decode ``Engine`` class's length, the modules
that read an export's integers, and, for each declared kind of state, the modules that name it.

    python scripts/layout_metrics.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "compress"
# how code names each kind of state: its class, what reads it, and the attribute it sits in on a
# module (as an attribute or a string; ``quantized`` is left out, other objects have one too)
KIND_NAMES = {
    "integer weight": ("QuantizedWeight", "quantized_of"),
    "input scheme": ("ActivationScheme", "input_quant_of", "input_quant"),
    "prune mask": ("PruneMask", "prune_mask_of", "apply_mask", "prune_mask"),
    "KV scheme": ("KVScheme", "kv_scheme"),
    "LoRA": ("LoRA", "lora"),
    "factored pair": ("Factored", "FactorPair"),
    "bitsandbytes 4-bit": ("Rounded4bit", "rounded_4bit_of", "bnb_4bit"),
}


def names_in(tree: ast.AST) -> set[str]:
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, (ast.ClassDef, ast.FunctionDef)):
            out.add(n.name)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            out.add(n.value)
    return out


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, tree: ast.AST) -> set[str]:
    """The package modules ``path`` imports (relative and absolute, at any depth)."""
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            for alias in node.names:
                out.add(f"{target}.{alias.name}")
                out.add(target)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {name for name in out if name.split(".")[0] == "compress"}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return found


def main() -> int:
    files = sorted(PACKAGE.rglob("*.py"))
    trees = {f: ast.parse(f.read_text()) for f in files}
    modules = {module_name(f) for f in files}
    graph = {}
    for f, tree in trees.items():
        me = module_name(f)
        # a module's own package (``compress.formats`` for ``compress.formats.x``) is not an import of it
        graph[me] = {m for m in imports_of(f, tree) if m in modules and m != me and not me.startswith(m + ".")}
    print(f"# layout of compress/: {len(files)} modules, {sum(len(f.read_text().splitlines()) for f in files)} lines")
    found = cycles(graph)
    print(f"import cycles: {len(found)}" + "".join(f"\n  {' -> '.join(c)}" for c in found))
    long_modules = sorted((n, str(f.relative_to(ROOT))) for f in files if (n := len(f.read_text().splitlines())) > 500)[
        ::-1
    ]
    print(f"modules over 500 lines: {len(long_modules)}" + "".join(f"\n  {p} ({n})" for n, p in long_modules))
    long_functions = sorted(
        (node.end_lineno - node.lineno + 1, f"{f.relative_to(ROOT)}:{node.lineno} {node.name}")
        for f, tree in trees.items()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.name != "build_parser"
        and node.end_lineno - node.lineno + 1 > 80
    )[::-1]
    print(f"functions over 80 lines: {len(long_functions)}" + "".join(f"\n  {w} ({n})" for n, w in long_functions))
    for f, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == "Engine":
                print(f"Engine: {node.end_lineno - node.lineno + 1} lines ({f.relative_to(ROOT)})")
    readers = sorted(str(f.relative_to(ROOT)) for f in files if "unpack_from_int32" in f.read_text())
    print(f"modules that unpack an export's integers: {len(readers)} ({', '.join(readers)})")
    print("modules that name each kind of state:")
    for kind, names in KIND_NAMES.items():
        users = sorted(
            str(f.relative_to(ROOT))
            for f, tree in trees.items()
            if any(
                isinstance(n, (ast.Name, ast.Attribute)) and getattr(n, "id", getattr(n, "attr", None)) in names
                for n in ast.walk(tree)
            )
            or any(isinstance(n, ast.ClassDef) and n.name in names for n in ast.walk(tree))
        )
        print(f"  {kind}: {len(users)} ({', '.join(users)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
