"""The budget script (.ci/budgets.py) on tiny trees: it flags a file over 300 lines, a
function over 60 lines (methods and nested ones too), an import cycle (lazy imports,
``from pkg import submodule`` and a package's ``__init__`` included) and an import that runs
back up the layers (engine < measure, nn, optim, testing < comm, models < parallel, faults <
checkpoint, plan, course < train), and passes a clean tree. It is not run on the real tree here: CI runs it (.ci/run, ``make budgets``)."""
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / ".ci" / "budgets.py"


def tree(tmp_path, files):
    """Write {relative path: text} under tmp_path/pkg (every folder a package)."""
    for rel, text in files.items():
        path = tmp_path / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for folder in [path.parent, *path.parent.parents]:
            if folder == tmp_path:
                break
            (folder / "__init__.py").touch()
        path.write_text(text)
    return tmp_path


def budgets(root):
    r = subprocess.run([sys.executable, str(SCRIPT), str(root), "--package", "pkg"],
                       capture_output=True, text=True, timeout=60)
    return r.returncode, r.stdout.splitlines()


def function(name, body_lines, indent=""):
    """A def of exactly 1 + body_lines lines."""
    return "".join([f"{indent}def {name}():\n"] + [f"{indent}    x = {i}\n" for i in range(body_lines)])


CLEAN = {
    "a.py": "import pkg.b\n" + function("f", 59),     # a 60-line function: on budget
    "b.py": "from pkg.sub import c\n",
    "sub/c.py": "from . import d\n",
    "sub/d.py": "x = 1\n" * 300,                        # a 300-line file: on budget
}


def test_clean_tree_passes(tmp_path):
    rc, out = budgets(tree(tmp_path, CLEAN))
    assert rc == 0, out
    assert len(out) == 1 and out[0].startswith("budgets ok: 6 files in pkg/"), out
    assert "0 import cycles" in out[0]


def test_long_file(tmp_path):
    rc, out = budgets(tree(tmp_path, {**CLEAN, "sub/d.py": "x = 1\n" * 301}))
    assert rc == 1
    assert "pkg/sub/d.py:1: file is 301 lines (budget 300)" in out, out
    assert out[-1] == "budgets: 1 violation(s)"


def test_long_function_decorators_excluded(tmp_path):
    src = ("import functools\n\n\n@functools.lru_cache()\n@functools.lru_cache()\n"
           + function("on_budget", 59) + "\n\n" + function("over", 60))
    rc, out = budgets(tree(tmp_path, {**CLEAN, "e.py": src}))
    assert rc == 1
    assert out[:-1] == ["pkg/e.py:68: function over is 61 lines (budget 60)"], out


def test_long_method_and_nested_function(tmp_path):
    src = ("class K:\n" + function("method", 61, "    ")
           + "\n\ndef outer():\n" + function("inner", 60, "    ") + "    return inner\n")
    rc, out = budgets(tree(tmp_path, {**CLEAN, "e.py": src}))
    assert rc == 1
    assert "pkg/e.py:2: function K.method is 62 lines (budget 60)" in out, out
    assert "pkg/e.py:67: function outer.inner is 61 lines (budget 60)" in out, out
    assert any(line.startswith("pkg/e.py:66: function outer is 63 lines") for line in out), out


def test_cycle_through_a_lazy_import(tmp_path):
    lazy = "def g():\n    from pkg import a\n    return a\n"
    rc, out = budgets(tree(tmp_path, {**CLEAN, "sub/d.py": lazy}))
    assert rc == 1
    cycle = [line for line in out if line.startswith("import cycle")]
    assert len(cycle) == 1, out
    assert cycle[0].startswith("import cycle of 4 modules (pkg.a, pkg.b, pkg.sub.c, pkg.sub.d)"), cycle
    for edge in ("pkg/a.py:1 imports pkg.b", "pkg/b.py:1 imports pkg.sub.c",
                 "pkg/sub/c.py:1 imports pkg.sub.d", "pkg/sub/d.py:2 imports pkg.a"):
        assert edge in cycle[0], cycle


def test_cycle_through_a_package_init(tmp_path):
    files = {**CLEAN, "sub/__init__.py": "from pkg.sub.c import d\n",
             "sub/d.py": "def g():\n    from pkg.sub import x\n"}
    rc, out = budgets(tree(tmp_path, files))
    assert rc == 1
    assert any(line.startswith("import cycle of 3 modules (pkg.sub, pkg.sub.c, pkg.sub.d)")
               for line in out), out


def test_from_package_import_submodule_is_that_submodule(tmp_path):
    # pkg/__init__ imports a, and a says `from pkg import b`: b is a submodule, so a imports
    # pkg.b, not pkg's __init__: no cycle ...
    files = {**CLEAN, "__init__.py": "from pkg import a\n", "a.py": "from pkg import b\n"}
    rc, out = budgets(tree(tmp_path, files))
    assert rc == 0, out
    # ... but a name defined in pkg's __init__ is an import of the __init__: a cycle
    files["a.py"] = "from pkg import b, helper\n"
    rc, out = budgets(tree(tmp_path, files))
    assert rc == 1
    assert any(line.startswith("import cycle of 2 modules (pkg, pkg.a): pkg/__init__.py:1 imports "
                               "pkg.a, pkg/a.py:1 imports pkg") for line in out), out


LAYERED = {                                             # every import down or across a layer
    "engine/autograd.py": "from pkg import errors\n",     # an unlisted module: no layer
    "engine/ops.py": "from pkg.engine import autograd\n",
    "nn.py": "from pkg.engine import ops\n",
    "measure/trace.py": "import pkg.engine.ops\nfrom pkg import nn\n",     # measure and nn: one layer
    "comm/group.py": "from pkg.measure import trace\n",
    "models/gpt.py": "from pkg import nn\n",
    "parallel/base.py": "from pkg.comm import group\nfrom pkg.models import gpt\n",
    "plan/model.py": "def f():\n    from ..measure import trace\n",
    "train/run.py": "from pkg.parallel import base\nfrom pkg.plan import model\n",
    "errors.py": "x = 1\n",
}


def test_layered_tree_passes(tmp_path):
    rc, out = budgets(tree(tmp_path, LAYERED))
    assert rc == 0, out
    assert len(out) == 1 and out[0].endswith("0 import cycles, 0 upward imports across 6 layers"), out


def test_upward_imports_each_with_its_line(tmp_path):
    files = {**LAYERED,                                 # (no cycle: only the layers are broken)
             "engine/ops.py": "from pkg.engine import autograd\n\n\ndef f():\n    from pkg.measure import memory\n",
             "measure/memory.py": "x = 1\n",
             "measure/trace.py": "from ..plan import model\nimport pkg.engine.ops\nfrom pkg.comm.group import x\n",
             "comm/group.py": "x = 1\n", "plan/model.py": "x = 1\n"}
    rc, out = budgets(tree(tmp_path, files))
    assert rc == 1
    assert out == [
        "pkg/engine/ops.py:5: upward import: pkg.engine.ops (layer 0, engine) imports pkg.measure.memory "
        "(layer 1, measure)",
        "pkg/measure/trace.py:1: upward import: pkg.measure.trace (layer 1, measure) imports pkg.plan.model "
        "(layer 4, plan)",
        "pkg/measure/trace.py:3: upward import: pkg.measure.trace (layer 1, measure) imports pkg.comm.group "
        "(layer 2, comm)",
        "budgets: 3 violation(s)"], out
