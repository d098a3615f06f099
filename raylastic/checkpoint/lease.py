"""One ``fit()`` per run at a time: a lease kept in the run's own storage.

Two ``fit()`` calls with the same ``storage_path`` and ``name`` would both write
``<run>/checkpoints/`` and delete each other's uncommitted directories. ``fit()`` therefore
takes a lease on the run before it starts anything: a small JSON record,
``<run>/.raylastic_lease.json``, naming the holder (host, pid, a random token), when it was
last renewed and when it expires. The holder renews it every ``ttl_s / 3`` from a thread of
the driver. While a lease is live, a second ``fit()`` fails at once with
:class:`RunInUseError`. When the holder dies, its lease expires ``ttl_s`` after its last
renewal and the next ``fit()`` takes the run over.

How a lease is taken (the same idea as etcd's or ZooKeeper's, on a plain store):

- Local storage: the first lease is created with ``O_CREAT | O_EXCL``, which the filesystem
  decides atomically; taking over an expired or released lease writes a new record by
  atomic rename.
- Object stores: pyarrow's filesystems expose no conditional PUT, so the taker writes its
  record, waits ``settle_s`` and reads it back. Two takers that both saw no live lease
  both write; each reads back the last write and only its writer proceeds. The window left
  is a taker whose read-to-write took longer than ``settle_s`` (1 s by default), which S3,
  GCS and Azure (strongly consistent reads after writes) make unlikely; docs/security.md
  says so.

The holder also *checks* the record on each renewal: if someone else's token is there (the
holder was paused past its expiry and the run was taken over), it stops renewing and the
run is stopped with ``RunInUseError``: one writer at a time, fenced by the token.

The record also carries the highest membership epoch the run has used, so a run resumed by
a later ``fit()`` continues the numbering (``checkpoint_<index>-e<epoch>`` directories are
never reused) instead of restarting at 1.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

from raylastic.checkpoint.manager import CHECKPOINT_DIR
from raylastic.errors import RunInUseError

logger = logging.getLogger("raylastic")

LEASE_FILE = ".raylastic_lease.json"
DEFAULT_TTL_S = 30.0
RELEASE_WAIT_S = 2.0  # how long fit() waits, at most, for the lease's last writes


@dataclass(frozen=True)
class LeaseRecord:
    holder: str  # "host pid=<pid>": for people
    token: str  # random: tells two holders apart even on one host
    renewed_ts: float
    expires_ts: float
    epoch: int = 0  # highest membership epoch the run has used so far
    released: bool = False

    def live(self, now: float) -> bool:
        return not self.released and now < self.expires_ts


def parse_record(raw: bytes) -> Optional[LeaseRecord]:
    """The lease in ``raw``, or None when it is not a lease record (treated as expired:
    the file is untrusted, and a garbled one must not lock a run forever)."""
    try:
        data = json.loads(raw.decode("utf-8"))
        rec = LeaseRecord(
            holder=str(data["holder"])[:200],
            token=str(data["token"]),
            renewed_ts=float(data["renewed_ts"]),
            expires_ts=float(data["expires_ts"]),
            epoch=int(data.get("epoch", 0)),
            released=data.get("released") is True,
        )
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError, OverflowError):
        return None
    if not (math.isfinite(rec.renewed_ts) and math.isfinite(rec.expires_ts)) or rec.epoch < 0:
        return None
    return rec


def highest_checkpoint_epoch(storage, run_rel: str) -> int:
    """The highest ``-e<epoch>`` among the run's checkpoint directories, committed or not."""
    best = 0
    for name in storage.list_dir(f"{run_rel}/checkpoints"):
        m = CHECKPOINT_DIR.match(name)  # the manager's own name pattern
        if m:
            best = max(best, int(m.group(2)))
    return best


class RunLease:
    """The lease on one run, held by this process between :meth:`acquire` and :meth:`release`."""

    def __init__(
        self,
        storage,
        run_rel: str,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        settle_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        on_lost: Optional[Callable[[str], None]] = None,
    ):
        self._storage = storage
        self._run_rel = run_rel
        self._rel = f"{run_rel}/{LEASE_FILE}"
        self._run = f"{storage.uri.rstrip('/')}/{run_rel}"
        self.ttl_s = float(ttl_s)
        self._settle_s = settle_s
        self._clock = clock
        self._on_lost = on_lost
        self.token = secrets.token_hex(16)
        self.holder = f"{socket.gethostname()} pid={os.getpid()}"
        self.epoch = 0  # the epoch floor: the next fit() starts above it
        self.lost: Optional[str] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    # -- taking and giving back ----------------------------------------------------
    def acquire(self) -> int:
        """Take the lease or raise RunInUseError. Returns the highest epoch the run used."""
        raw = self._read_raw()
        prev = None if raw is None else self._parse(raw)
        now = self._clock()
        if prev is not None and prev.live(now) and prev.token != self.token:
            raise self._in_use(prev, now)
        self.epoch = max(prev.epoch if prev else 0, highest_checkpoint_epoch(self._storage, self._run_rel))
        mine = self._record(now)
        if self._storage.is_local and raw is None:
            if not self._create_exclusive(mine):  # the filesystem decided: someone else was first
                raise self._in_use(self._read() or mine, self._clock(), raced=True)
        elif not self._write_and_read_back(mine):
            raise self._in_use(self._read() or mine, self._clock(), raced=True)
        self._thread = threading.Thread(target=self._renew_loop, name="raylastic-lease", daemon=True)
        self._thread.start()
        return self.epoch

    def note_epoch(self, epoch: int) -> None:
        """The run has formed membership epoch ``epoch``; the next renewal records it."""
        with self._lock:
            self.epoch = max(self.epoch, int(epoch))

    def release(self) -> None:
        """Stop renewing and mark the lease released (kept: it carries the epoch floor).

        Waits at most ``RELEASE_WAIT_S`` for each step: when the store is down (the run may
        have failed for that very reason) ``fit()`` returns at once and the lease simply
        expires ``ttl_s`` after its last renewal."""
        self._stop.set()
        renewer, self._thread = self._thread, None
        if renewer is not None:
            renewer.join(timeout=RELEASE_WAIT_S)
            if renewer.is_alive():  # a renewal stuck on the store could land after our release
                logger.warning(
                    "lease on %s not released (the store is not answering); it expires in %.0f s", self._run, self.ttl_s
                )
                return
        if self.lost is not None:
            return  # someone else holds it now: never write over their record
        writer = threading.Thread(target=self._write_released, name="raylastic-lease-release", daemon=True)
        writer.start()
        writer.join(timeout=RELEASE_WAIT_S)

    def _write_released(self) -> None:
        try:
            cur = self._read()
            if cur is None or cur.token == self.token:
                rec = self._record(self._clock())
                self._storage.write_bytes(self._rel, _encode(LeaseRecord(**{**asdict(rec), "released": True})))
        except Exception as e:  # noqa: BLE001 - the lease then expires on its own
            logger.warning("could not release the lease on %s (%s); it expires in %.0f s", self._run, e, self.ttl_s)

    # -- renewing ------------------------------------------------------------------
    def renew(self) -> bool:
        """Renew once; False (and ``lost`` set) when another holder's record is there."""
        cur = self._read()
        if cur is not None and cur.token != self.token:
            self.lost = (
                f"the lease on run {self._run} was taken over by {cur.holder} (this process "
                f"did not renew it within {self.ttl_s:.0f} s); stopping so that only one "
                "fit() writes the run"
            )
            return False
        self._storage.write_bytes(self._rel, _encode(self._record(self._clock())))
        return True

    def _renew_loop(self) -> None:
        period = self.ttl_s / 3
        while not self._stop.wait(period):
            try:
                if not self.renew():
                    lost = self.lost
                    assert lost is not None  # renew() sets it when it returns False
                    logger.error("%s", lost)
                    if self._on_lost is not None:
                        self._on_lost(lost)
                    return
            except Exception as e:  # noqa: BLE001 - a storage blip: try again next period
                logger.warning("could not renew the lease on %s: %s", self._run, e)

    # -- helpers -------------------------------------------------------------------
    def _record(self, now: float) -> LeaseRecord:
        with self._lock:
            epoch = self.epoch
        return LeaseRecord(
            holder=self.holder, token=self.token, renewed_ts=now, expires_ts=now + self.ttl_s, epoch=epoch
        )

    def _read_raw(self) -> Optional[bytes]:
        try:
            return self._storage.read_bytes(self._rel)
        except FileNotFoundError:
            return None

    def _read(self) -> Optional[LeaseRecord]:
        raw = self._read_raw()
        return None if raw is None else self._parse(raw)

    def _parse(self, raw: bytes) -> Optional[LeaseRecord]:
        rec = parse_record(raw)
        if rec is None:
            logger.warning("ignoring an unreadable lease record at %s/%s", self._run, LEASE_FILE)
        return rec

    def _create_exclusive(self, rec: LeaseRecord) -> bool:
        """Create the record only if none exists, whole: written to a temp file, then
        hard-linked to the final name (``link`` fails if the name exists), so nobody ever
        reads a half-written record and takes it for a garbled one."""
        path = self._storage.path(self._rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{self.token}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(_encode(rec))
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError:  # a mount without hard links (some FUSE/SMB): write and read back
            return self._write_and_read_back(rec)
        finally:
            os.unlink(tmp)
        return True

    def _write_and_read_back(self, rec: LeaseRecord) -> bool:
        self._storage.write_bytes(self._rel, _encode(rec))
        if self._settle_s > 0:
            self._stop.wait(self._settle_s)
        back = self._read()
        return back is not None and back.token == self.token

    def _in_use(self, rec: LeaseRecord, now: float, raced: bool = False) -> RunInUseError:
        left = max(0.0, rec.expires_ts - now)
        how = "took the lease at the same moment" if raced else "holds its lease"
        return RunInUseError(
            f"run {self._run} is in use: {rec.holder} {how} (renewed every {self.ttl_s / 3:.0f} s, "
            f"expires in {left:.0f} s if its holder stops). Fix: wait for that fit() to finish, or "
            "pick another RunConfig.name; if its holder is dead, start again after the lease "
            "expires (RunConfig.lease_ttl_s).",
            run=self._run,
            holder=rec.holder,
            expires_in_s=left,
        )


def _encode(rec: LeaseRecord) -> bytes:
    return json.dumps(asdict(rec), sort_keys=True).encode()
