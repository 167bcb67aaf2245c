"""The graded job's report channel: reports the student's code cannot forge by printing.

Contract. The grader (``Channel()``) makes a private folder (``mkdtemp``, mode 0700) and a
random 32-byte key, and writes the key once per rank (``key.<rank>``, mode 0600). The
job gets the folder's path in ``PDIST_GRADE_CHANNEL``. Each rank, before it loads the
student's module (``Reporter.from_env()``), reads its key file, deletes it and removes
the variable from ``os.environ``; from then on the key lives only in that rank's memory.
Each report is one line ``HMAC-SHA256(key, payload).hex() + " " + payload`` (payload:
JSON) appended to ``rank<r>.jsonl`` in the folder. The grader accepts a line only if its
HMAC is valid; stdout is never read for results. So printing a fake report line, or
writing one into the folder, earns nothing.

What it does not stop: code that digs the key out of the checks' own memory (frames,
``gc``) in the same process. That needs a sandbox (a separate user or container).
"""
import hashlib
import hmac
import json
import os
import secrets
import shutil
import tempfile

ENV = "PDIST_GRADE_CHANNEL"


def sign(key, payload):
    return hmac.new(key, payload.encode(), hashlib.sha256).hexdigest()


class Channel:
    """The grader's side: ``env(ranks)`` for the launch, ``read()`` afterwards, ``close()``."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="pdist-grade-")
        self.key = secrets.token_bytes(32)

    def env(self, ranks):
        for r in range(ranks):
            fd = os.open(os.path.join(self.dir, f"key.{r}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(self.key.hex().encode())
        return {ENV: self.dir}

    def read(self, ranks):
        """(reports, forged): the validly signed reports of ranks 0..ranks-1, in file order,
        and the number of lines that were not."""
        good, bad = [], 0
        for r in range(ranks):
            try:
                with open(os.path.join(self.dir, f"rank{r}.jsonl"), "rb") as f:
                    raw = f.read(1 << 24)               # 16 MiB: far above any honest run
            except OSError:
                continue
            for line in raw.decode("utf-8", errors="replace").splitlines():
                mac, _, payload = line.partition(" ")
                try:
                    ok = hmac.compare_digest(mac, sign(self.key, payload))
                    rep = json.loads(payload) if ok else None
                except (ValueError, TypeError):
                    ok = False
                if ok and isinstance(rep, dict) and rep.get("rank") == r:
                    good.append(rep)
                else:
                    bad += 1
        return good, bad

    def close(self):
        shutil.rmtree(self.dir, ignore_errors=True)     # the folder this Channel made


class Reporter:
    """The graded rank's side. ``from_env()`` takes the key (see the module docstring);
    ``report(**fields)`` appends one signed line. Without ``PDIST_GRADE_CHANNEL`` (a
    student running the checks by hand) it prints the reports unsigned."""

    def __init__(self, path=None, key=None):
        self._path, self._key = path, key

    @classmethod
    def from_env(cls, rank):
        d = os.environ.pop(ENV, None)
        if not d:
            return cls()
        kf = os.path.join(d, f"key.{rank}")
        try:
            with open(kf, "rb") as f:
                key = bytes.fromhex(f.read().decode())
            os.unlink(kf)
        except (OSError, ValueError) as e:
            raise SystemExit(f"pdist grader: rank {rank} has no key in {d} ({e}); "
                             "was this job started by python -m pdist.grade?")
        return cls(os.path.join(d, f"rank{rank}.jsonl"), key)

    def report(self, **fields):
        payload = json.dumps(fields, sort_keys=True)
        if self._key is None:
            print("[pdist report] " + payload, flush=True)
            return
        fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, (sign(self._key, payload) + " " + payload + "\n").encode())
        finally:
            os.close(fd)
