"""What the grader checks in a submission before it launches anything.

``screen(folder, exercise_id, file_name)`` returns ``(path, tree, None)`` for a file that can
be graded, else ``(None, None, problem)`` with ``problem = (status, msg)``:

* ``missing``: no such file (with the closest names found: a misnamed file is reported
  as "expected ex03_bucketed_ddp.py; found ex3_bucketed.py");
* ``failing``: a directory where the file should be, a file that is not UTF-8 text, or
  one Python cannot parse (syntax error, nesting too deep for the parser);
* ``not started``: every exercise function still raises ``NotImplementedError("exercise:")``;
* ``uses the library's answer``: the file imports the reference answers (any module path
  with a part containing "solutions") or the library's own implementation of what the
  exercise asks for (``FORBIDDEN``; an import, an attribute chain from an imported
  module, ``importlib.import_module``/``__import__`` of a constant, or a forbidden method
  call). Each exercise's docstring says what it may use, and nothing it allows is listed.
"""
import ast
import difflib
from pathlib import Path

MAX_BYTES = 1 << 20     # a 1 MiB exercise file is not an answer
# The grader's own wrong answers (tests/fixtures/wrong/) break one function each and import
# the others from the reference answers; only there is that allowed.

_DDP = "the library's DataParallel does this exercise for you"
FORBIDDEN = {
    "01": [("pdist.comm.algorithms.allreduce_ring", "pdist's own ring all-reduce"),
           ("pdist.comm.algorithms.allreduce_naive", "pdist's own all-reduce"),
           ("pdist.comm.algorithms.reduce_scatter_ring", "pdist's own ring reduce-scatter"),
           ("pdist.comm.algorithms.all_gather_ring", "pdist's own ring all-gather"),
           ("mpi4py", "MPI's own all-reduce (the exercise allows isend/irecv/sendrecv only)"),
           (".all_reduce", "a collective all-reduce (the exercise allows isend/irecv/sendrecv only)"),
           (".reduce_scatter", "a collective (the exercise allows isend/irecv/sendrecv only)"),
           (".all_gather", "a collective (the exercise allows isend/irecv/sendrecv only)")],
    "02": [("pdist.parallel.data_parallel", _DDP), ("pdist.parallel.DataParallel", _DDP),
           ("pdist.parallel.DataParallelNaive", _DDP)],
    "03": [("pdist.parallel.data_parallel", "the library's bucketed DDP (build_buckets, DataParallel)"),
           ("pdist.parallel.DataParallel", "the library's bucketed DDP")],
    "04": [("pdist.parallel.zero", "the library's ZeRO"), ("pdist.parallel.ZeRO", "the library's ZeRO")],
    "05": [("pdist.parallel.zero.zero", "the library's ZeRO"), ("pdist.parallel.ZeRO", "the library's ZeRO"),
           (".gather_buffer", "FlatParamUnit's own gather"), (".finish_gather", "FlatParamUnit's own gather"),
           (".drop_grads", "FlatParamUnit's own reduction"), (".free", "FlatParamUnit's own free")],
    "06": [("pdist.parallel.tensor", "the library's tensor-parallel layers"),
           ("pdist.parallel.TensorParallel", "the library's tensor parallelism")],
    "07": [("pdist.parallel.tensor.layers.vocab_parallel_cross_entropy", "the library's vocab-parallel CE")],
    "08": [("pdist.parallel.pipeline.schedules.one_f_one_b", "the library's 1F1B schedule"),
           ("pdist.parallel.pipeline.schedules.interleaved_1f1b", "the library's interleaved 1F1B"),
           ("pdist.parallel.pipeline.schedules.make_schedule", "the library's schedules")],
    "09": [("pdist.checkpoint", "the checkpoint reader's own box overlap")],
    "11": [("pdist.parallel.context.ring_attention", "the library's ring attention and its merge"),
           ("pdist.parallel.context.RingAttention", "the library's ring attention and its merge"),
           ("pdist.engine.attention", "the library's whole-sequence attention")],
    "12": [("pdist.parallel.expert_parallel", "the library's expert parallelism (ExpertDispatch, AllToAllV)"),
           ("pdist.parallel.ExpertParallel", "the library's expert parallelism"),
           ("pdist.models.moe.route", "the library's routing"), (".apply_experts", "the library's MoE layer")],
    "13": [("pdist.parallel.pipeline.zero_bubble", "the library's zero-bubble schedules"),
           ("pdist.parallel.pipeline.schedules.make_schedule", "the library's schedules"),
           ("pdist.parallel.pipeline.schedules.zb", "the library's zero-bubble schedules")],
}


def screen(folder, eid, fname, known=()):
    """See the module docstring; ``known``: every exercise's file name (never suggested for
    another one)."""
    folder = Path(folder)
    path = folder / fname
    if not path.exists():
        return None, None, ("missing", missing_msg(folder, fname, known))
    if not path.is_file():
        return None, None, ("failing", f"{fname} is a {'directory' if path.is_dir() else 'special file'}, "
                                       "not a Python file: put your answer in a file of that name")
    try:
        raw = path.read_bytes() if path.stat().st_size <= MAX_BYTES else None
        if raw is None:
            return None, None, ("failing", f"{fname} is over {MAX_BYTES >> 20} MiB: not an exercise answer")
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, None, ("failing", f"{fname} is not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 4]!r}); "
                                       "save it as UTF-8")
    except OSError as e:
        return None, None, ("failing", f"{fname} cannot be read ({e.strerror or e})")
    tree, problem = parse(text, fname)
    if problem:
        return None, None, ("failing", problem)
    if not_started_tree(tree):
        return None, None, ("not started", "")
    reason = uses_library_answer(tree, eid)
    if reason:
        return None, None, ("uses the library's answer", reason)
    return path, tree, None


def missing_msg(folder, fname, known=()):
    try:
        found = sorted(p.name for p in folder.iterdir() if p.suffix == ".py" and p.name not in known)
    except OSError:
        found = []
    close = difflib.get_close_matches(fname, found, n=3, cutoff=0.6)
    if not close:
        close = [n for n in found if n[:4] == fname[:4] or n.split("_")[0] == fname.split("_")[0]][:3]
    return f"expected {fname}" + (f"; found {', '.join(close)}" if close else f" in {folder}")


def parse(text, fname):
    """(tree, None) or (None, why it cannot be parsed)."""
    try:
        return ast.parse(text, filename=fname), None
    except SyntaxError as e:
        return None, f"syntax error line {e.lineno}: {e.msg}"
    except (RecursionError, MemoryError):
        return None, f"{fname} nests too deeply for Python's parser: split the expression"
    except ValueError as e:                          # e.g. a null byte
        return None, f"{fname} cannot be parsed: {e}"


def not_started(path):
    """True when every function of the file that raises NotImplementedError("exercise: ...")
    does nothing else (a docstring may precede it), and there is at least one: nothing
    has been written yet. A file with some functions written is launched, and its first
    unwritten function fails its check with "not written yet"."""
    return not_started_tree(ast.parse(Path(path).read_text()))


def not_started_tree(tree):
    todo = 0
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if not any(_is_todo(s) for s in ast.walk(node)):
            continue
        body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                                             and isinstance(s.value.value, str))]
        if len(body) != 1 or not _is_todo(body[0]):
            return False
        todo += 1
    return todo > 0


def _is_todo(stmt):
    if not isinstance(stmt, ast.Raise) or stmt.exc is None:
        return False
    exc = stmt.exc
    name = exc.func.id if isinstance(exc, ast.Call) and isinstance(exc.func, ast.Name) else \
        exc.id if isinstance(exc, ast.Name) else None
    if name != "NotImplementedError":
        return False
    args = exc.args if isinstance(exc, ast.Call) else []
    return bool(args) and isinstance(args[0], ast.Constant) and str(args[0].value).startswith("exercise:")


def uses_library_answer(tree, eid):
    """Why the file uses the library's answer to exercise ``eid``, or None."""
    names, methods = referenced(tree)
    for n in sorted(names):
        if any("solutions" in part for part in n.split(".")):
            return f"imports the reference answers ({n})"
    for target, reason in FORBIDDEN.get(eid, []):
        if target.startswith("."):
            if target[1:] in methods:
                return f"calls {target[1:]}(): {reason}"
            continue
        hits = [n for n in names if n == target or n.startswith(target + ".")]
        if hits:
            hit = max(hits, key=len)
            return f"uses {hit}: {reason}"
    return None


def referenced(tree):
    """(dotted names the file imports or reaches from an imported module, method names called)."""
    alias, names, methods = {}, set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names.add(a.name)
                alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            for a in node.names:
                names.add(f"{node.module}.{a.name}")
                alias[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Call):
            if isinstance(node.func, ast.Attribute):
                methods.add(node.func.attr)
            called = _dotted(node.func)
            if called in ("importlib.import_module", "import_module", "__import__") and node.args \
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                names.add(node.args[0].value)
    for node in ast.walk(tree):
        d = _dotted(node) if isinstance(node, ast.Attribute) else None
        if d and d.split(".")[0] in alias:
            names.add(alias[d.split(".")[0]] + d[len(d.split(".")[0]):])
    return names, methods


def _dotted(node):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id] + parts[::-1])
    return None
