"""The suite's cores, shared by pytest-xdist's workers (``make test`` runs ``pytest -n``).

Contract. The machine has C usable cores and the workers share a pool of U = 4*C *rank
units* (``PDIST_TEST_UNITS`` overrides): the suite's ranks mostly wait (on a peer, on a
watchdog's timeout), and its distributed tests have always run 4 ranks on 2 cores, so two
such jobs may share 2 cores, never more. A test holds 1 unit while it runs; each ``pdist.testing.launch`` of n
ranks holds min(n, U) instead, for as long as its job runs; a test marked
``@pytest.mark.cores("all")`` (timing-sensitive) or ``cores(k)`` holds that many for its
whole run, its own launches included. Requests are served first come, first served and
all at once, and nobody waits while holding units (a launch gives its test's unit back
before it queues), so no request starves and none deadlocks. So at most U ranks run at a
time, whatever the number of workers, and a timing test runs with no other test beside it.

The pool is a small JSON file under a lock (``fcntl.flock``) in the temporary directory,
named by the pid of the pytest that started the workers (it removes the files at its end);
a holder that died (its pid is gone) loses its units. Without xdist (``pytest tests/x.py``)
none of this is active.

Also here: the tests ``make test-fast`` leaves out (SLOW), those that hold the whole pool
(ALONE), the order in which xdist's workers take the tests (``dealt``: whole-pool tests,
then the longest, first) and a one-time bytecode compile (``compile_bytecode``).
"""
import contextlib
import fcntl
import glob
import json
import os
import shutil
import sys
import tempfile
import time

import pytest

RUN = None           # the pool's name, the controller's pid: set in an xdist worker only


def _path(run):
    return os.path.join(tempfile.gettempdir(), f"pdist-test-cores-{run}.json")


def _cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


UNITS = int(os.environ.get("PDIST_TEST_UNITS", 4 * _cores()))
_mine, _launches = [0], [0]                   # units this worker holds now; launches it started


def _alive(pid):
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - another user's pid: treat as alive
        return True
    return True


@contextlib.contextmanager
def _pool():
    path = _path(RUN)
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with open(path) as f:
                state = json.load(f)
        except (OSError, ValueError):
            state = {"held": {}, "queue": []}
        state["held"] = {p: k for p, k in state["held"].items() if _alive(p)}
        state["queue"] = [p for p in state["queue"] if _alive(p)]
        yield state
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.replace(tmp, path)                 # atomically: a reader never sees half a file


def _set(k):
    """Hold exactly k units (0 <= k <= UNITS): give back at once, or queue for more."""
    me, k = str(os.getpid()), min(k, UNITS)
    if k <= _mine[0]:
        with _pool() as st:
            st["held"][me] = k
        _mine[0] = k
        return
    with _pool() as st:                       # nobody waits while holding: give back first
        st["held"][me] = 0
        st["queue"].append(me)
    _mine[0], delay = 0, 0.005
    while True:
        with _pool() as st:
            free = UNITS - sum(st["held"].values())
            if st["queue"] and st["queue"][0] == me and free >= k:
                st["queue"].pop(0)
                st["held"][me] = k
                _mine[0] = k
                return
        time.sleep(delay)
        delay = min(0.05, delay * 2)


@contextlib.contextmanager
def holding(k, exactly=False):
    """Hold at least k units inside the block, or ``exactly`` k (0: waiting on tests/shared_launch.py)."""
    before = _mine[0]
    if RUN is None or min(k, UNITS) == before or (min(k, UNITS) < before and not exactly):
        yield
        return
    _set(k)
    try:
        yield
    finally:
        _set(before)


def _counted(launch):
    def launch_counted(n, *args, **kwargs):
        _launches[0] += 1
        with holding(int(n)):
            return launch(n, *args, **kwargs)
    launch_counted.__wrapped__, launch_counted.__doc__ = launch, launch.__doc__
    return launch_counted


# The tests `make test-fast` leaves out (marked ``slow`` at collection): each took 15 s or more in
# a run of the whole suite under pytest-xdist (-n 4) on 2 cores at load average 12-15
# (AMD EPYC, 2026-12-01); about 3-5 s each on a quiet machine. A node id, or its beginning.
SLOW = [
    "tests/test_gpu_standin.py::test_file_passes_on_the_standin",   # host test cases, again
    "tests/test_layouts.py::test_layouts_equal_single_process[n8-",  # 8 ranks
    "tests/test_debug.py::test_lesson_08_passes_and_its_trace_validates",
    "tests/test_grade.py::test_class_mode_rejects_each_wrong_answer",
    "tests/test_grade.py::test_reference_gets_full_points",
    "tests/test_comm.py::test_collectives[4]", "tests/test_precision.py::test_loss_curve_close_to_fp32",   # comm: [4] only
    "tests/test_lessons_02_03.py::test_lesson_03_rss_meta_init_and_timeline",
    "tests/test_recompute.py::test_layouts_train_the_same_with_recompute[n4-2of2]",   # --dp 4 --zero 3; --dp 2 --tp 2 --sp
    "tests/test_checkpoint.py::test_bad_checkpoints_raise_the_same_error_on_every_rank_and_touch_nothing",
    "tests/test_checkpoint.py::test_a_plain_model_saves_and_loads_as_one_process",
    "tests/test_precision_layouts.py::test_pipeline_and_sequence_parallel_equal_one_process",
    "tests/test_precision_layouts.py::test_two_byte_collectives_sum_in_fp32_and_round_once[3]",
    "tests/test_lessons_04_05.py::test_lesson_05_mixed_precision",
    "tests/test_failures.py::test_object_collective_mismatch[4]",
    "tests/test_tensor_parallel.py::test_gpt_equivalence_and_comm_counts[4]",
    "tests/test_lesson_07.py::test_lesson_07_mixed_precision", "tests/test_killed_suite.py::",
    "tests/test_plan.py::test_lesson_06_memory_and_group_bytes_equal_the_plan",
]


# Tests that hold the whole pool (as if marked cores("all")): their messages name where each
# rank waits, which a rank starved of a core under a second job reaches late (seen 2 in 5
# runs of test_exception_on_one_rank[harness-4] under -n 4 at load 5-6).
ALONE = ["tests/test_failures.py::",
         # the grader grades in parallel up to the cores, in subprocesses (uncounted launches)
         "tests/test_grade.py::test_reference", "tests/test_grade.py::test_class_mode"]


# Tests that take longest (6-45 s of CPU each under -n 4 on 2 cores, AMD EPYC, load 13-20, 2026-12-01) and the
# readers that start the longest shared launches: started first, one per worker in turn, none left alone at the end.
LONG = [
    "tests/test_gpu_standin.py::test_file_passes_on_the_standin", "tests/test_killed_suite.py::",
    "tests/test_gpu_standin.py::test_device_defects_fixed_with_lazy_streams",
    "tests/test_deterministic.py::test_layouts_same_bits_under_mpiexec",
    "tests/test_layouts.py::test_layouts_equal_single_process[n4-dp-2-tp-2]",      # its own 4-rank launch,
    "tests/test_layouts.py::test_layouts_equal_single_process[n2-dp-2]",           # and 2-rank one
    "tests/test_context_parallel.py::test_cp_composes_at_8_ranks",                 # the suite's 8-rank launch,
    "tests/test_zero_bubble.py::test_zero_bubble_schedules_equal_one_process",     # 2- and 4-rank ones
    "tests/test_comm.py::test_collectives[3]", "tests/test_zero.py::test_lesson_03_json_contract",   # 3-rank one
    "tests/test_precision_layouts.py::test_layout_equals_one_process_in_the_same_precision",
    "tests/test_context_parallel.py::test_cp4_and_cp2_dp2_and_zero_equal_one_process",
    "tests/test_lessons_02_03.py::test_lesson_03_rss_meta_init_and_timeline",
    "tests/test_expert_parallel.py::test_expert_parallel_equals_one_process_and_checkpoints_reshard",
    "tests/test_lesson_06.py::test_lesson_06_pairs_at_4_ranks[--dp 2 --tp 2]",
    "tests/test_plan.py::test_lesson_03_bytes_equal_the_plan[4]", "tests/test_lesson_07.py::test_lesson_07_at_4_ranks",
    "tests/test_grade.py::test_each_wrong_answer", "tests/test_precision.py::test_loss_curve",
    "tests/test_grader_runner.py::test_class_mode_progress_json_and_a_stuck_student_capped",   # 30 s of a cap
]


# The tests that import torch or transformers (optional; about 5.5 s of CPU to import, once in
# each process that does): dealt to one worker, one after another, so the suite imports them
# once. test_checkpoint.py goes whole: its transformers test shares the module's 4-rank save.
TORCH = ["tests/test_llama.py::", "tests/test_torch_reference.py::", "tests/test_checkpoint.py::",
         "tests/test_optim.py::test_clip_matches_torch",
         "tests/test_precision.py::test_grad_scaler_matches_torch_amp_grad_scaler"]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(item.nodeid.startswith(p) for p in SLOW):
            item.add_marker(pytest.mark.slow)
        if any(item.nodeid.startswith(p) for p in ALONE) and item.get_closest_marker("cores") is None:
            item.add_marker(pytest.mark.cores("all"))
    workers = int(getattr(config, "workerinput", {}).get("workercount", 0))
    if workers > 1:
        items[:] = dealt(items, workers)


def dealt(items, workers):
    """The order under pytest-xdist (every worker computes the same one): its load scheduler
    first hands each of the W workers a run of about N/W/4 consecutive tests, then the rest
    in small runs as they finish. So the whole-pool tests (``cores("all")``) and then the
    LONG ones are dealt one per worker in turn at the head of those first runs: the
    whole-pool tests all run at the start, one after another, while nothing else is in
    flight (the pool drains once, not once for each), and the long ones run side by side,
    early. The TORCH tests follow in the head of the worker with the fewest of those (torch is
    imported once per suite, not once per worker). The other tests keep their order (and
    their module fixtures)."""
    def whole(it):
        m = it.get_closest_marker("cores")
        return m is not None and m.args[0] == "all"
    alone = [it for it in items if whole(it)]
    long_ = [it for it in items if not whole(it) and any(it.nodeid.startswith(p) for p in LONG)]
    picked = {id(it) for it in alone + long_}
    torch = [it for it in items if id(it) not in picked and any(it.nodeid.startswith(p) for p in TORCH)]
    picked |= {id(it) for it in torch}
    rest = [it for it in items if id(it) not in picked]
    run = max(2, len(items) // workers // 4)
    heads = [[] for _ in range(workers)]
    for i, it in enumerate(alone + long_):
        heads[i % workers].append(it)
    heads[len(alone + long_) % workers] += torch           # the next in turn: one of the fewest
    out = []
    for head in heads:
        fill = max(0, run - len(head))
        out += head + rest[:fill]
        rest = rest[fill:]
    return out + rest


def pytest_configure(config):
    """In an xdist worker (``workerinput``; a pytest that a test starts in a subprocess
    inherits the worker's environment but is none): count the launches. This runs before
    the test modules import ``launch``, so they import the counted one."""
    global RUN
    if not hasattr(config, "workerinput"):
        compile_bytecode()
    if hasattr(config, "workerinput") and RUN is None:
        RUN = os.getppid()
        import pdist.testing
        pdist.testing.launch = _counted(pdist.testing.launch)
    config.addinivalue_line("markers", "cores(k): the test holds k rank units (\"all\": the whole "
                                       "pool) for its whole run under pytest-xdist (tests/conftest.py)")


def compile_bytecode():
    """Under ``PYTHONDONTWRITEBYTECODE`` (set in many CI and container images) each of the
    suite's processes (every rank of every launch) would compile pdist from source again,
    about 0.07 s of CPU each (2-core AMD EPYC, 2026-12-01); the pytest that starts
    the suite compiles pdist/ and the CuPy stand-in once instead (``compileall``, into
    the usual ``__pycache__`` folders, which git ignores; never the lessons or the test
    fixtures, whose folders tests list), and the processes read it (they write nothing).
    ``PDIST_TEST_BYTECODE=0`` leaves it."""
    if not sys.flags.dont_write_bytecode or os.environ.get("PDIST_TEST_BYTECODE") == "0":
        return
    import compileall
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isfile(os.path.join(root, "pdist", "__init__.py")):
        return                                # this conftest copied elsewhere (tests/test_killed_suite.py)
    for sub in ("pdist", os.path.join("tests", "strict_cupy")):   # what the ranks import (scripts are not cached)
        if os.path.isdir(os.path.join(root, sub)):
            compileall.compile_dir(os.path.join(root, sub), quiet=2)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    mark = item.get_closest_marker("cores")
    want = 1 if mark is None else UNITS if mark.args[0] == "all" else int(mark.args[0])
    with holding(want), _cpu_seconds(item.nodeid):
        yield


@contextlib.contextmanager
def _cpu_seconds(nodeid):
    """``PDIST_TEST_CPU=FILE``: one JSON line per test, its CPU seconds (the worker's own and its
    waited-for children's: every launch's mpiexec and ranks), a load-independent cost that keeps the
    suite's budget, and its launches (a shared one in the test that ran it); ``sort`` them."""
    path = os.environ.get("PDIST_TEST_CPU")
    if not path:
        yield
        return
    import resource

    def now():
        a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime
    t0, k0 = now(), _launches[0]
    try:
        yield
    finally:
        with open(path, "a") as f:
            f.write(json.dumps({"test": nodeid, "cpu_s": round(now() - t0, 2),
                                "launches": _launches[0] - k0}) + "\n")


def pytest_unconfigure(config):
    """The controller (no ``workerinput``) removes its workers' files (pool, lock, shared_launch.py's)."""
    if not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None):
        for p in glob.glob(glob.escape(_path(os.getpid())) + "*"):
            with contextlib.suppress(FileNotFoundError):
                (shutil.rmtree if os.path.isdir(p) else os.remove)(p)      # a folder: a lesson's --dir
