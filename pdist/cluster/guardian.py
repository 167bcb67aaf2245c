"""The guardian: ``python -m pdist.cluster.guardian ID``, started by the harness (Box),
detached by setsid, with a pipe as its stdin. The harness never writes to the pipe; when the
harness ends, however it ends (returns, Ctrl-C, SIGTERM, SIGKILL, its process group killed), the
kernel closes the pipe's write end and the guardian reads EOF. It then removes everything the
run's state record names (pdist/cluster/state.py: processes inside the nodes, namespaces and
their links, the run's folder, the record) and exits. SIGTERM to the guardian does the same at
once; SIGINT and SIGHUP are ignored (a terminal's Ctrl-C is the harness's to handle).
"""
import os
import signal
import sys

from pdist.cluster import state


def _teardown(run_id):
    rec = state.read(os.path.join(state.state_dir(), run_id + ".json"))
    if rec is not None:
        state.remove(rec)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not state.ID.fullmatch(argv[0]):
        print("usage: python -m pdist.cluster.guardian RUN_ID (8 hex digits; started by pdist.cluster.Box)",
              file=sys.stderr)
        return 2
    run_id = argv[0]
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)

    def on_term(sig, frame):
        _teardown(run_id)
        os._exit(0)
    signal.signal(signal.SIGTERM, on_term)
    while True:                         # until EOF: the harness is gone (or closed the pipe)
        try:
            if not os.read(0, 4096):
                break
        except InterruptedError:
            continue
        except OSError:
            break
    signal.signal(signal.SIGTERM, signal.SIG_IGN)     # the teardown must finish
    _teardown(run_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
