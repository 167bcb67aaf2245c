"""The box's files, in the run's folder: the agent that enters a node (the box's "ssh"), the
nodes' hosts file and the MPI hostfile. Written atomically.

The agent is what mpiexec calls where a real cluster has ssh (MPICH: ``-launcher ssh
-launcher-exec AGENT``; Open MPI: ``--mca plm_rsh_agent AGENT``): ``AGENT [ssh options] NODE
COMMAND...``. It skips ssh's options, checks that NODE is one of this box's nodes, and runs
COMMAND (joined with spaces and given to ``sh -c``, as ssh does) inside the node (``enter``).
"""
import os

SSH_OPTS_WITH_ARG = "BbcDEeFIiJLlmOopQRSWw"


def enter(p, node, hosts):
    """argv prefix that runs a command (``sh -c '...' sh ARGS``: appended) inside ``node``: its
    network namespace, its own hostname (UTS), IPC and mount namespaces, a fresh tmpfs on
    /dev/shm (so MPI cannot take shared memory across nodes) and the box's hosts file on
    /etc/hosts (the node names resolve to the nodes' addresses). ``unshare -m`` makes the mounts
    private: nothing is mounted on the host."""
    ns = p["netns"][p["nodes"].index(node)]
    script = (f'hostname {node} && mount -t tmpfs -o mode=1777 tmpfs /dev/shm && '
              f'mount --bind {hosts} /etc/hosts && exec "$@"')
    return ["ip", "netns", "exec", ns, "unshare", "-u", "-i", "-m", "sh", "-c", script, "sh"]


def agent_script(p, hosts):
    """The agent's text: the node's name reaches the inner shell as $1, the command as $2."""
    ns = f'pdist-{p["id"]}-"$host"'
    inner = (f'hostname "$1" && mount -t tmpfs -o mode=1777 tmpfs /dev/shm && '
             f'mount --bind {hosts} /etc/hosts && exec sh -c "$2"')
    nodes = " ".join(p["nodes"])
    return f"""#!/bin/sh
# pdist box {p["id"]}: the "ssh" of this box. mpiexec runs: AGENT [ssh options] NODE COMMAND...
while [ $# -gt 0 ]; do
  case "$1" in
    -[{SSH_OPTS_WITH_ARG}]) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
host=$1
[ $# -gt 0 ] && shift
case " {nodes} " in
  *" $host "*) ;;
  *) echo "pdist box agent: no node '$host' in box {p["id"]} (nodes: {nodes})" >&2; exit 255 ;;
esac
exec ip netns exec {ns} unshare -u -i -m sh -c '{inner}' sh "$host" "$*"
"""


def hosts_text(p):
    lines = ["127.0.0.1 localhost", "::1 localhost"]
    return "\n".join(lines + [f"{p['address'][n]} {n}" for n in p["nodes"]]) + "\n"


def hostfile_text(p, ranks_per_node, mpi):
    """MPICH: ``node1:2`` per line; Open MPI: ``node1 slots=2``."""
    fmt = "{n}:{k}" if mpi == "mpich" else "{n} slots={k}"
    return "\n".join(fmt.format(n=n, k=ranks_per_node) for n in p["nodes"]) + "\n"


def write(path, text, mode=0o644):
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)
    return path


def write_all(p, folder, ranks_per_node, mpi):
    """{"agent", "hosts", "hostfile"}: the three files' paths in ``folder``."""
    hosts = write(os.path.join(folder, "hosts"), hosts_text(p))
    return {"hosts": hosts, "agent": write(os.path.join(folder, "agent"), agent_script(p, hosts), 0o755),
            "hostfile": write(os.path.join(folder, "hostfile"), hostfile_text(p, ranks_per_node, mpi))}
