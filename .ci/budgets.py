#!/usr/bin/env python3
"""The budgets a reader can trust, checked over a package (stdlib only, Python 3.9+).

    python3 .ci/budgets.py [ROOT] [--package pdist]

* no file over 300 lines;
* no function over 60 lines: every ``def`` (methods and nested ones too), measured with
  ``ast`` as ``end_lineno - lineno + 1`` (the ``def`` line to the last line, decorators
  excluded);
* no import cycle among the package's modules. Every ``import`` and ``from ... import``
  counts, lazy ones inside functions too; ``from pkg import name`` where ``pkg.name`` is a
  submodule is an import of that submodule, otherwise of ``pkg``; a package's
  ``__init__.py`` is a module like any other (a submodule that imports a name from the
  package whose ``__init__`` imports it back is a cycle);
* no import runs back up the layers (``LAYERS``, from the floor up; folders and modules
  named relative to the package). A module of layer i may import modules of layers <= i
  and the package's unlisted modules (``pdist/__init__.py``, ``data.py``, ``errors.py``,
  ...: no layer, not checked either way); every import of a module of a higher layer,
  lazy ones too, each with its line, is a violation.

Prints each violation with its path, line and size and exits 1; otherwise prints one
summary line and exits 0."""
import argparse
import ast
import pathlib
import sys

MAX_FILE_LINES = 300
MAX_FUNCTION_LINES = 60
LAYERS = (                       # from the floor up (docs/design.md, "Modules")
    ("engine",),                 # arrays, autograd, ops
    ("measure", "nn", "optim", "testing", "cluster"),
    ("comm", "models"),
    ("parallel", "faults"),
    ("checkpoint", "plan", "course"),
    ("train",),
)


def module_name(root, path):
    """``pdist/comm/group.py`` -> ``pdist.comm.group``; ``pdist/comm/__init__.py`` -> ``pdist.comm``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def long_functions(tree, limit):
    """[(line, qualified name, size)] of every def longer than ``limit`` lines."""
    out = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}."
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = child.end_lineno - child.lineno + 1
                if size > limit:
                    out.append((child.lineno, name[:-1], size))
            visit(child, name)

    visit(tree, "")
    return out


def count_functions(tree):
    return sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(tree))


def resolve(name, modules):
    """The longest prefix of dotted ``name`` that is a module of the package (or None)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_lines(tree, mod, is_pkg, modules):
    """[(imported module, line)] of every import of the package's modules (``ast.walk``'s order)."""
    out = []

    def add(target, line):
        if target is not None and target != mod:
            out.append((target, line))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(resolve(alias.name, modules), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                add(sub if sub in modules else resolve(target, modules), node.lineno)
    return out


def imports_of(lines):
    """{imported module: the first line ``import_lines`` gives for it}."""
    out = {}
    for target, line in lines:
        out.setdefault(target, line)
    return out


def layer_of(mod, package):
    """(index, name) of the layer holding ``mod`` (``LAYERS``), or None for an unlisted module."""
    for i, names in enumerate(LAYERS):
        for name in names:
            full = f"{package}.{name}"
            if mod == full or mod.startswith(full + "."):
                return i, name
    return None


def upward_imports(rel, mod, lines, package):
    """Violations: each import by ``mod`` of a module in a higher layer than its own."""
    mine, bad = layer_of(mod, package), []
    for target, line in sorted(lines, key=lambda e: e[1]):
        theirs = layer_of(target, package)
        if mine is not None and theirs is not None and theirs[0] > mine[0]:
            bad.append(f"{rel}:{line}: upward import: {mod} (layer {mine[0]}, {mine[1]}) imports {target} "
                       f"(layer {theirs[0]}, {theirs[1]})")
    return bad


def strongly_connected(graph):
    """Tarjan's strongly connected components with more than one module (iterative)."""
    index, low, on, stack, comps, counter = {}, {}, set(), [], [], 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))
    return comps


def one_cycle(comp, graph):
    """A shortest cycle through the component's first module: [m0, m1, ..., m0]."""
    members, start = set(comp), comp[0]
    parent, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    path = [v]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    return path[::-1] + [start]
                if w in members and w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp + [comp[0]]  # unreachable for a strongly connected component


def check(root, package):
    """(violations as printable lines, summary line)."""
    root = pathlib.Path(root).resolve()
    paths = sorted((root / package).rglob("*.py"))
    if not paths:
        return [f"{root / package}: no Python files (is ROOT the repository root?)"], ""
    modules = {module_name(root, p): p for p in paths}
    bad, graph, n_funcs = [], {}, 0
    for mod, path in modules.items():
        rel = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8")
        n_lines = len(text.splitlines())
        if n_lines > MAX_FILE_LINES:
            bad.append(f"{rel}:1: file is {n_lines} lines (budget {MAX_FILE_LINES})")
        tree = ast.parse(text, filename=rel)
        n_funcs += count_functions(tree)
        for line, name, size in long_functions(tree, MAX_FUNCTION_LINES):
            bad.append(f"{rel}:{line}: function {name} is {size} lines (budget {MAX_FUNCTION_LINES})")
        lines = import_lines(tree, mod, path.name == "__init__.py", modules)
        graph[mod] = imports_of(lines)
        bad += upward_imports(rel, mod, lines, package)
    comps = strongly_connected(graph)
    for comp in comps:
        cyc = one_cycle(comp, graph)
        edges = ", ".join(f"{modules[a].relative_to(root).as_posix()}:{graph[a][b]} imports {b}"
                          for a, b in zip(cyc, cyc[1:]))
        bad.append(f"import cycle of {len(comp)} modules ({', '.join(comp)}): {edges}")
    summary = (f"budgets ok: {len(modules)} files in {package}/ (none over {MAX_FILE_LINES} lines), "
               f"{n_funcs} functions (none over {MAX_FUNCTION_LINES} lines), 0 import cycles, "
               f"0 upward imports across {len(LAYERS)} layers")
    return bad, summary


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", nargs="?", default=str(pathlib.Path(__file__).resolve().parent.parent),
                    help="the repository root (default: this script's repository)")
    ap.add_argument("--package", default="pdist", help="the package folder under ROOT (default pdist)")
    args = ap.parse_args(argv)
    bad, summary = check(args.root, args.package)
    for line in bad:
        print(line)
    if bad:
        print(f"budgets: {len(bad)} violation(s)")
        return 1
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
