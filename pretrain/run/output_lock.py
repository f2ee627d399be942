"""One writer per output: the lock every command that writes a run directory, a dataset or a converted model
takes first (`python -m pretrain train`, `data_tools preprocess`, `merge`, `convert to-hf` / `from-hf`).

The lock is a file holding its holder's record (host, pid, Slurm job and restart count, start time), inside the
directory it guards (`RUN_DIR/writer.lock`, `CHECKPOINT_DIR/writer.lock`) or beside the output (`PREFIX.lock`,
`HF_DIR.lock`). It is created atomically without `flock` (which Lustre and NFS mounts often lack): the record is
written to a temporary first and hard-linked to the lock's name (`link(2)` fails when the name exists, also on
NFS); where the file system has no hard links, `O_CREAT|O_EXCL`. A second writer is refused with one line naming
the holder. The holder refreshes the file's modification time every `PRETRAIN_LOCK_HEARTBEAT_S` seconds
(default 15) and removes the file when it ends (normal exit, or one of its one-line errors).

A lock whose holder is gone is taken over, with one note, when one of these facts says so:
  1. the same Slurm job (`SLURM_JOB_ID`) with a higher `SLURM_RESTART_COUNT`: the holder is an earlier attempt
     of this job (a requeue), which Slurm ended before starting this one;
  2. the same host (host name and kernel boot id) and PID namespace: its pid is not running, or now belongs to
     a process started at another time (pid reuse); a different boot id: the host rebooted;
  3. otherwise (another host, or another PID namespace): no heartbeat for `STALE_BEATS` (8) of the holder's
     heartbeat intervals, measured on the file system's clock (the lock's mtime against that of a file just
     written), so clocks of different nodes need not agree.
Taking over goes through a short-lived `LOCK.break` file, so two restarts racing for one stale lock cannot both
win. A record that cannot be read is treated as one being written for `UNREADABLE_GRACE_S`, then as stale.
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

LOCK_NAME = "writer.lock"  # inside a directory the lock guards
STALE_BEATS = 8
UNREADABLE_GRACE_S = 60.0
BREAK_STALE_S = 60.0
DEFAULT_HEARTBEAT_S = 15.0
# Creating the lock failed for a reason of the file system itself (read-only, full, not a directory, forbidden):
# nobody can write there, so the command goes on without a lock and its own check reports the path.
_UNWRITABLE = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EEXIST, errno.ENOSPC, errno.EDQUOT,
               errno.ENOENT, errno.EISDIR}
_NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EMLINK, errno.ENOSYS}


class OutputLocked(RuntimeError):
    """An output is held by another live writer (the message names it), or its lock cannot be taken."""


def _remove(path: Path) -> None:
    """Remove a temporary if it is there (a read-only file system refuses even a missing one: EROFS)."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def heartbeat_s() -> float:
    try:
        value = float(os.environ.get("PRETRAIN_LOCK_HEARTBEAT_S", DEFAULT_HEARTBEAT_S))
    except ValueError:
        value = DEFAULT_HEARTBEAT_S
    return value if value > 0 else DEFAULT_HEARTBEAT_S


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks since boot) of a Linux process; None where /proc cannot say."""
    text = _read_text(f"/proc/{pid}/stat")
    if not text or ")" not in text:
        return None
    fields = text.rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses
    return (fields[0], fields[19]) if len(fields) > 19 else None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


@dataclass(frozen=True)
class Holder:
    """Who holds a lock: what the staleness rules compare."""

    host: str
    pid: int
    pid_start: str | None  # /proc/PID/stat start time: tells a reused pid from the holder
    boot_id: str | None  # the host's kernel boot: a reboot ends every holder on it
    pid_ns: str | None  # pids are compared only inside one PID namespace (containers)
    slurm_job_id: str | None
    slurm_restart_count: int
    started: str
    heartbeat_s: float
    token: str
    command: str

    @classmethod
    def this_process(cls) -> Holder:
        stat = _proc_stat(os.getpid())
        try:
            restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
        except ValueError:
            restarts = 0
        return cls(socket.gethostname(), os.getpid(), stat[1] if stat else None,
                   _read_text("/proc/sys/kernel/random/boot_id"), _pid_namespace(),
                   os.environ.get("SLURM_JOB_ID") or None, restarts, time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                   heartbeat_s(), uuid.uuid4().hex, " ".join(sys.argv)[:300])

    @classmethod
    def parse(cls, raw: bytes) -> Holder | None:
        try:
            d = json.loads(raw.decode("utf-8"))
            return cls(str(d["host"]), int(d["pid"]), d.get("pid_start"), d.get("boot_id"), d.get("pid_ns"),
                       d.get("slurm_job_id"), int(d.get("slurm_restart_count") or 0), str(d.get("started", "?")),
                       float(d.get("heartbeat_s") or DEFAULT_HEARTBEAT_S), str(d["token"]), str(d.get("command", "")))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    def record(self) -> bytes:
        return (json.dumps(asdict(self)) + "\n").encode("utf-8")

    def describe(self) -> str:
        job = (f"Slurm job {self.slurm_job_id} (restart {self.slurm_restart_count})" if self.slurm_job_id
               else "no Slurm job")
        return f"host {self.host}, pid {self.pid}, {job}, started {self.started}"


def stale_reason(holder: Holder, age_s: float, me: Holder) -> str | None:
    """Why `holder` is gone, from facts this process can check; None while it may be alive.

    `age_s`: seconds since the holder's last heartbeat, on the file system's clock."""
    if holder.slurm_job_id and holder.slurm_job_id == me.slurm_job_id \
            and me.slurm_restart_count > holder.slurm_restart_count:
        return (f"it is restart {holder.slurm_restart_count} of this Slurm job {me.slurm_job_id}, now at restart "
                f"{me.slurm_restart_count} (a requeue)")
    same_host = holder.host == me.host and (holder.boot_id is None or me.boot_id is None
                                            or holder.boot_id == me.boot_id)
    if holder.host == me.host and holder.boot_id and me.boot_id and holder.boot_id != me.boot_id:
        return f"host {holder.host} has rebooted since"
    if same_host and holder.pid_ns == me.pid_ns:
        if holder.pid == me.pid and holder.pid_start == me.pid_start:
            return "it is this process"  # a lock left by this process (e.g. an earlier run in it that failed)
        stat = _proc_stat(holder.pid)
        if stat is None:
            try:
                os.kill(holder.pid, 0)
            except ProcessLookupError:
                return f"process {holder.pid} is not running"
            except PermissionError:
                pass
            return None
        if stat[0] in ("Z", "X"):
            return f"process {holder.pid} has exited"
        if holder.pid_start is not None and stat[1] != holder.pid_start:
            return f"process {holder.pid} is not running (the pid now belongs to another process)"
        return None
    limit = STALE_BEATS * holder.heartbeat_s
    if age_s > limit:
        return (f"no heartbeat for {age_s:.0f} s ({STALE_BEATS} missed beats of {holder.heartbeat_s:g} s: its host "
                "is down or the process is gone)")
    return None


class Target(NamedTuple):
    """An output to lock: `path`, named `what` in messages; its lock lies inside it (a directory the writer keeps)
    or beside it (`PATH.lock`: a prefix of files, or a directory replaced as a whole); `create_parent`: the writer
    creates missing parent directories (else, without the parent, there is nothing to lock: the writer refuses)."""

    path: str | os.PathLike
    what: str
    inside: bool = False
    create_parent: bool = False


class OutputLock:
    """The lock of one output (a directory, a dataset prefix, a converted model)."""

    def __init__(self, target: str | os.PathLike, what: str, inside: bool = False, create_parent: bool = False) -> None:
        self.target, self.what, self.inside, self.create_parent = Path(target), what, inside, create_parent
        self.path = self.target / LOCK_NAME if inside else Path(f"{os.fspath(target)}.lock")
        self.key = os.path.abspath(self.path)
        self.holder: Holder | None = None
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- taking it ---------------------------------------------------------------------------------------
    def acquire(self) -> str | None:
        """Take the lock; returns a note when a stale lock was taken over. Raises `OutputLocked` when another
        live writer holds it. Without a writable place for it (read-only, full, missing parent) no lock is
        taken and None returned: the command's own checks then name the path."""
        if self.inside or self.create_parent:
            try:
                (self.target if self.inside else self.path.parent).mkdir(parents=True, exist_ok=True)
            except OSError:
                return None
        elif not self.path.parent.is_dir():
            return None
        me = Holder.this_process()
        note = None
        for attempt in range(5):
            tmp = self.path.with_name(f".{self.path.name}.{me.host}.{me.pid}.{me.token[:8]}.tmp")
            try:
                with open(tmp, "wb") as f:
                    f.write(me.record())
                    f.flush()
                    os.fsync(f.fileno())
                fs_now = tmp.stat().st_mtime
            except OSError as exc:
                _remove(tmp)
                if exc.errno in _UNWRITABLE:
                    return None
                raise OutputLocked(f"{self.what} {self.target}: cannot create its lock {self.path} "
                                   f"({exc.strerror or exc})") from exc
            try:
                if self._create(tmp, me):
                    self._start(me)
                    return note
                raw, holder, mtime = self._read()
                if raw is None:
                    continue  # released meanwhile: try again
                age = fs_now - mtime
                if holder is None:
                    reason = f"its record is unreadable and {age:.0f} s old" if age > UNREADABLE_GRACE_S else None
                else:
                    reason = stale_reason(holder, age, me)
                if reason is None:
                    raise OutputLocked(self._refusal(holder, age))
                if self._break(raw, fs_now):
                    who = holder.describe() if holder is not None else "an unknown holder"
                    note = f"note: took over the stale lock {self.path} of {who}: {reason}"
                elif attempt:
                    time.sleep(0.2)
            finally:
                _remove(tmp)
        raise OutputLocked(f"{self.what} {self.target}: its lock {self.path} is being taken over by another process "
                           "at the same time; try again")

    def holder_alive(self) -> str | None:
        """The refusal a writer would get now (a live holder), or None (no lock, or a stale one); takes nothing."""
        raw, holder, mtime = self._read()
        if raw is None:
            return None
        me = Holder.this_process()
        probe = self.path.with_name(f".{self.path.name}.{me.host}.{me.pid}.{me.token[:8]}.probe")
        try:  # the file system's clock, as `acquire` measures it
            probe.write_bytes(b"")
            fs_now = probe.stat().st_mtime
        except OSError:
            fs_now = time.time()
        finally:
            _remove(probe)
        age = fs_now - mtime
        if holder is None:
            return None if age > UNREADABLE_GRACE_S else self._refusal(None, age)
        return None if stale_reason(holder, age, me) is not None else self._refusal(holder, age)

    def _create(self, tmp: Path, me: Holder) -> bool:
        """Link the written record to the lock's name; False when the name exists."""
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return self._linked(tmp)  # NFS: the link was made but the reply was lost, and the retry failed
        except OSError as exc:
            if self._linked(tmp):
                return True
            if exc.errno not in _NO_HARD_LINKS:
                raise
        try:  # no hard links on this file system: exclusive create (a reader may briefly see an empty record)
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(me.record())
            f.flush()
            os.fsync(f.fileno())
        return True

    @staticmethod
    def _linked(tmp: Path) -> bool:
        try:
            return tmp.stat().st_nlink == 2
        except OSError:
            return False

    def _read(self) -> tuple[bytes | None, Holder | None, float]:
        try:
            with open(self.path, "rb") as f:
                mtime = os.fstat(f.fileno()).st_mtime
                raw = f.read(1 << 16)
        except FileNotFoundError:
            return None, None, 0.0
        return raw, Holder.parse(raw), mtime

    def _break(self, stale_raw: bytes, fs_now: float) -> bool:
        """Remove the stale lock whose content is `stale_raw`, unless it changed meanwhile (then False)."""
        breaker = Path(f"{self.path}.break")
        try:
            os.close(os.open(breaker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            try:
                if fs_now - breaker.stat().st_mtime > BREAK_STALE_S:  # a breaker that died while breaking
                    _remove(breaker)
            except FileNotFoundError:
                pass
            return False
        try:
            raw, _, _ = self._read()
            if raw != stale_raw:
                return False
            self.path.unlink(missing_ok=True)
            return True
        finally:
            _remove(breaker)

    def _refusal(self, holder: Holder | None, age: float) -> str:
        who = holder.describe() if holder is not None else "a process whose record is still being written"
        return (f"{self.what} {self.target} is in use by another writer: {who} (lock {self.path}, last heartbeat "
                f"{max(age, 0):.0f} s ago); wait for it to end or stop it (the lock of a writer that is gone is taken "
                "over automatically)")

    # -- holding and releasing ---------------------------------------------------------------------------
    def _start(self, me: Holder) -> None:
        self.holder, self.pid = me, os.getpid()
        _HELD[self.key] = self
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat {self.path.name}", daemon=True)
        self._thread.start()

    def still_held(self) -> bool:
        raw, holder, _ = self._read()
        return holder is not None and self.holder is not None and holder.token == self.holder.token

    def _beat(self) -> None:
        interval = self.holder.heartbeat_s
        while not self._stop.wait(interval):
            try:
                if not self.still_held():
                    self.lost = True
                    print(f"warning: lost the lock {self.path}: another process took it over (this one missed its "
                          "heartbeats, e.g. it was stopped); it no longer owns "
                          f"{self.target}", file=sys.stderr, flush=True)
                    return
                os.utime(self.path)
            except OSError:
                continue  # a transient file-system error: the next beat tries again

    def release(self) -> None:
        """Remove the lock if this process still holds it (a forked child never does)."""
        if self.holder is None or getattr(self, "pid", None) != os.getpid():
            return
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        try:
            if self.still_held():
                self.path.unlink()
        except OSError:
            pass
        _HELD.pop(self.key, None)
        self.holder = None


_HELD: dict[str, OutputLock] = {}


class Held:
    """The locks one command holds; released together (also as a context manager)."""

    def __init__(self, locks: list[OutputLock]) -> None:
        self.locks = locks

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release()
        self.locks = []

    def __enter__(self) -> Held:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def hold(targets: Iterable[Target], log: Callable[[str], None] | None = None) -> Held:
    """Take the locks of `targets` in a fixed order, all or none.

    A lock this process already holds is reused. Raises `OutputLocked` naming the holder of the first one held
    elsewhere; `log` gets the note of each stale lock taken over."""
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    locks = sorted((OutputLock(*t) for t in targets), key=lambda lk: lk.key)
    taken: list[OutputLock] = []
    try:
        for lock in locks:
            mine = _HELD.get(lock.key)
            if mine is not None and mine.still_held():
                taken.append(mine)
                continue
            note = lock.acquire()
            if lock.holder is not None:
                taken.append(lock)
            if note:
                log(note)
    except BaseException:
        Held(taken).release()
        raise
    return Held(taken)


def release_all() -> None:
    """Release every lock this process holds (at exit, and at the end of a CLI command)."""
    for lock in list(_HELD.values()):
        lock.release()


atexit.register(release_all)


def run_targets(cfg) -> list[Target]:
    """What a trainer writes: run.dir, and checkpoint.dir where it lies outside run.dir."""
    targets = [Target(cfg.run.dir, "run.dir", inside=True)]
    ckpt = cfg.checkpoint.dir
    if ckpt and not os.path.abspath(ckpt).startswith(os.path.abspath(cfg.run.dir) + os.sep):
        targets.append(Target(ckpt, "checkpoint.dir", inside=True))
    return targets


def hold_run_outputs(cfg, rank: int, share: Callable[[str | None], str | None],
                     log: Callable[[str], None]) -> Held:
    """The trainer's lock: rank 0 takes it on run.dir (and an outside checkpoint.dir) before any file is written;
    `share` (an all-ranks collective returning any rank's message) tells every rank the verdict, so all of them
    raise `OutputLocked` together when another writer holds the directory."""
    held, message = Held([]), None
    if rank == 0:
        try:
            held = hold(run_targets(cfg), lambda note: log(f"[pretrain] {note}"))
        except OutputLocked as exc:
            message = str(exc)
        except OSError as exc:  # not left to one rank: the others would wait in `share` forever
            message = f"run.dir {cfg.run.dir}: cannot take its lock ({exc.strerror or exc})"
    message = share(message)
    if message:
        held.release()
        raise OutputLocked(message)
    return held



def run_outputs_held(cfg) -> str | None:
    """The refusal a trainer of `cfg` would get now because a live writer holds its run.dir (or checkpoint.dir),
    else None; takes nothing (`python -m pretrain validate --check-lock`, which launch/common.sh runs)."""
    for target in run_targets(cfg):
        refusal = OutputLock(*target).holder_alive()
        if refusal:
            return refusal
    return None
