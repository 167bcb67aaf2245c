"""What ``save`` owns on disk, and how it claims, replaces and cleans it (docs/checkpoint.md).

Beside a checkpoint ``parent/<base>`` pdist writes only names that start with
``.<base>.pdist-``, and inside a checkpoint only ``index.json`` and ``rank-NNNNN.safetensors``:

    .<base>.pdist-lock              the writer's lock: {"pid", "host", "start", "nonce"}, whole from
                                    the start (hard-linked from its .new-<pid>-<hex>; reclaimed via .stale-*)
    .<base>.pdist-tmp-<pid>-<hex>   the directory being written; renamed to <base> when complete
    .<base>.pdist-old-<pid>-<hex>   the previous <base> during an overwrite where the file
                                    system cannot exchange two names atomically

A lock whose process is gone (same host, and the pid is dead or was reused by a later
process) is stale: the next writer reclaims it. The next ``save`` in a parent removes the
leftovers of saves that died there (whose lock is free or stale), deleting only the names
above (a lock's .new-/.stale- name once 10 s old and its pid gone); a leftover ``-old-`` whose
``<base>`` is missing is renamed back (it is complete).
"""
import json
import os
import re
import secrets
import socket
import time
import warnings

from pdist.checkpoint.format import INDEX, LEFTOVER, CheckpointError, aside_copies, exchange, fsync_dir, read_index

RANK_FILE = re.compile(r"rank-\d{5}\.safetensors")
LOCK = re.compile(r"\.(?P<base>.+)\.pdist-lock")
LOCK_TEMP = re.compile(r"\.(?P<base>.+)\.pdist-lock\.(new|stale)-(?P<pid>\d+)-[0-9a-f]{8}")   # Lock's own names
LOCK_GRACE_S = 10.0       # a lock file still empty after this long was never finished: stale


def tmp_name(dir):
    return _sibling(dir, f"tmp-{os.getpid()}-{secrets.token_hex(4)}")


def aside_name(dir):
    return _sibling(dir, f"old-{os.getpid()}-{secrets.token_hex(4)}")


def lock_name(dir):
    return _sibling(dir, "lock")


def _sibling(dir, what):
    parent, base = os.path.split(dir)
    return os.path.join(parent, f".{base}.pdist-{what}")


def _start_time(pid):
    """The process's start time in clock ticks since boot (/proc), or None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _alive(holder):
    """Whether the process recorded in a lock may still run: another host, or a pid that
    is alive and started when the lock says (not a later process reusing the pid)."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:             # alive, another user's
        pass
    start, now = holder.get("start"), _start_time(pid)
    return start is None or now is None or now == start


class Lock:
    """``.<base>.pdist-lock``: one writer per checkpoint path. ``acquire`` raises
    CheckpointError naming the holder when a live process holds it; a stale one is reclaimed."""

    def __init__(self, dir):
        self.dir, self.path, self.held = dir, lock_name(dir), None

    def _holder(self):
        try:
            with open(self.path) as f:
                text = f.read()
            mtime = os.stat(self.path).st_mtime
        except FileNotFoundError:
            return None
        try:
            return json.loads(text)
        except ValueError:                  # being written, or its writer died mid-write
            return {} if time.time() - mtime > LOCK_GRACE_S else {"host": "?", "pid": "(being written)"}

    def acquire(self):
        me = {"pid": os.getpid(), "host": socket.gethostname(), "start": _start_time(os.getpid()),
              "nonce": secrets.token_hex(8), "since": time.time()}
        for _ in range(5):
            if not self._create(json.dumps(me)):
                holder = self._holder()
                if holder is None:
                    continue                    # released in between: try again
                if holder and _alive(holder):
                    raise CheckpointError(self._busy(holder))
                self._reclaim(holder)
                continue
            self.held = me
            return self
        raise CheckpointError(f"{self.path}: could not take the lock (it keeps changing hands); "
                              "another save to this path is running")

    def _create(self, text):
        """The lock, holding ``text`` from its first moment: a name of ours hard-linked to it (link(2)
        fails where it exists, as O_EXCL does; no hard links: O_EXCL and a write). False: taken."""
        mine = f"{self.path}.new-{os.getpid()}-{secrets.token_hex(4)}"
        with open(mine, "x") as f:
            f.write(text)
        try:
            try:
                os.link(mine, self.path)
            except FileExistsError:
                return False
            except OSError:                      # no hard links on this file system
                with os.fdopen(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "w") as f:
                    f.write(text)
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(mine)

    def _reclaim(self, holder):
        """Remove the stale lock read as ``holder`` ({}: never finished): rename it to a
        name of ours first, so only one reclaimer deletes it, and give it back if a live
        writer had taken the lock in between."""
        grab = f"{self.path}.stale-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            os.rename(self.path, grab)
        except FileNotFoundError:
            return
        try:
            with open(grab) as f:
                now = json.loads(f.read())
        except ValueError:
            now = {}
        if now != holder:
            try:
                os.link(grab, self.path)
            except OSError:
                pass
        os.unlink(grab)

    def _busy(self, holder):
        since = holder.get("since")
        when = time.strftime(" since %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else ""
        return (f"{self.dir}: another save is writing this checkpoint (lock {self.path} held by pid "
                f"{holder.get('pid')} on host {holder.get('host')}{when}); wait for it, or save to another "
                f"path; if no such process runs any more, delete {self.path}")

    def try_acquire(self):
        """acquire, or None where another live writer holds the lock."""
        try:
            return self.acquire()
        except CheckpointError:
            return None

    def release(self):
        if self.held is not None:
            try:
                with open(self.path) as f:
                    mine = json.loads(f.read()).get("nonce") == self.held["nonce"]
            except (OSError, ValueError):
                mine = False
            if mine:
                os.unlink(self.path)
            self.held = None


def foreign(dir):
    """The entries of ``dir`` that pdist does not write into a checkpoint (sorted)."""
    return sorted(n for n in os.listdir(dir) if not (n == INDEX or RANK_FILE.fullmatch(n))
                  or not os.path.isfile(os.path.join(dir, n)) or os.path.islink(os.path.join(dir, n)))


def remove_pdist_dir(path):
    """Delete what pdist writes into ``path`` (``index.json`` first: it stops being a
    checkpoint at once; then the rank files), then the directory if nothing else is
    left. Returns the entries left (not pdist's), [] when the directory is gone."""
    names = sorted(os.listdir(path), key=lambda n: n != INDEX)
    for n in names:
        p = os.path.join(path, n)
        if (n == INDEX or RANK_FILE.fullmatch(n)) and os.path.isfile(p) and not os.path.islink(p):
            os.unlink(p)
    left = os.listdir(path)
    if not left:
        os.rmdir(path)
    return sorted(left)


def between_renames():
    """Called between the two renames of the fallback overwrite (a test kills the process here)."""


def swap_in(tmp, dir):
    """Put the complete ``tmp`` at ``dir``. A new name (or an empty directory): one rename.
    An existing checkpoint: exchange the two names atomically and delete the old one; where
    that is not possible, rename the old one aside (``.<base>.pdist-old-*``: ``latest`` and the
    next save find it), rename ``tmp`` in, then delete the old one."""
    parent = os.path.dirname(dir)
    if os.path.isdir(dir) and os.listdir(dir):
        if swap_in.exchange(tmp, dir):
            fsync_dir(parent)
            remove_pdist_dir(tmp)
            return
        old = aside_name(dir)
        os.rename(dir, old)
        swap_in.between_renames()
        os.rename(tmp, dir)
        fsync_dir(parent)
        remove_pdist_dir(old)
    else:
        os.rename(tmp, dir)
        fsync_dir(parent)


swap_in.exchange, swap_in.between_renames = exchange, between_renames      # tests replace these


def clean_leftovers(parent, mine=None):
    """Remove what dead saves left in ``parent`` (see the module docstring); ``mine``: the
    base whose lock the caller holds. Returns the names removed or restored."""
    found, done = {}, []
    for n in os.listdir(parent):
        m, lock = LEFTOVER.fullmatch(n), LOCK.fullmatch(n)
        if m and os.path.isdir(os.path.join(parent, n)) and not os.path.islink(os.path.join(parent, n)):
            found.setdefault(m.group("base"), []).append((m.group("kind"), n))
        elif lock:
            found.setdefault(lock.group("base"), [])        # a stale lock alone: taking it removes it
        elif (t := LOCK_TEMP.fullmatch(n)) and _dead_temp(os.path.join(parent, n), int(t.group("pid"))):
            done.append(n)
    for base, items in sorted(found.items()):
        dir = os.path.join(parent, base)
        lock = None if base == mine else Lock(dir).try_acquire()
        if base != mine and lock is None:
            continue                        # a live save is using these
        try:
            done += _clean_base(parent, dir, sorted(items, key=lambda kn: kn[0] == "tmp"))
        finally:
            if lock is not None:
                lock.release()
    return done


def _dead_temp(path, pid):
    """Remove a lock's temporary name (``.new-``, ``.stale-``: a writer holds one for the
    microseconds between two calls) that a killed writer left: a plain file older than
    LOCK_GRACE_S whose pid runs no process here. True when removed."""
    try:
        if not os.path.isfile(path) or os.path.islink(path) or time.time() - os.lstat(path).st_mtime < LOCK_GRACE_S:
            return False
        if _start_time(pid) is not None:        # that pid runs here: maybe the writer, stopped
            return False
        os.unlink(path)
        return True
    except OSError:
        return False


def _clean_base(parent, dir, items):
    done = []
    for kind, n in items:
        path = os.path.join(parent, n)
        if kind == "old" and not os.path.lexists(dir):
            try:
                read_index(path)
                os.rename(path, dir)            # the interrupted overwrite's complete old checkpoint
                done.append(n)
                continue
            except CheckpointError:
                pass
        if kind == "old" and not _is_checkpoint(dir):
            continue                            # <base> is not a checkpoint: keep the only copy
        left = remove_pdist_dir(path)
        if left:
            warnings.warn(f"{path}: left in place: it holds {', '.join(left)}, which pdist did not write",
                          stacklevel=3)
        else:
            done.append(n)
    return done


def _is_checkpoint(dir):
    try:
        read_index(dir)
        return True
    except CheckpointError:
        return False


__all__ = ["Lock", "aside_copies", "clean_leftovers", "foreign", "remove_pdist_dir", "swap_in", "tmp_name"]
