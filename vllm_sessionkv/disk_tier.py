"""Disk tier beneath the host-DRAM tier: session KV the host tier evicts is spilled
to files, and read back into host slots when a later request needs it
(``docs/tiers.md``).

Two halves, one per connector role, like ``host_tier.py``:

* :class:`DiskTierIndex` (scheduler process, no torch) knows which block hashes have
  a file, keeps them least-recently-used first within a byte cap, and records
  ``stored``/``removed`` events (published with ``medium="STORAGE"``, the medium
  vLLM's own file tier uses).  It validates the directory at start-up (absolute,
  writable, not used by another engine: an exclusive ``flock`` on ``.lock``), drops
  leftover temporary files and files of the wrong size, and re-indexes the files a
  previous run left, oldest first (vLLM's default block hash, sha256 with a fixed
  seed, names the same tokens the same way in every run).
* :class:`DiskBlockStore` (worker process) writes one host slot to one file and reads
  one file back into a host slot.  A write goes to a temporary file that is renamed
  into place, so a crash leaves no partial file under a block's name.  Every file
  carries a header: a magic, the KV layout's fingerprint (model, dtype, per-layer
  block shapes; another model's or layout's file is refused), the block hash it
  holds, the payload length and a BLAKE2b checksum of the payload.  A read checks
  all of them before it writes a byte into the host slot; a file that fails any
  check is deleted and reported refused, and the request recomputes those tokens.

The scheduler plans every disk operation as a ``HostCopy`` in the one ordered list
the worker runs each step (``metadata.py``): a spill is planned before the host
store that reuses the evicted slot, and a drop of a file after any read of it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import struct
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_sessionkv.host_tier import HostBlockPool

__all__ = [
    "DiskBlockStore",
    "DiskTierIndex",
    "file_bytes",
    "layout_fingerprint",
]

logger = logging.getLogger("vllm.sessionkv.disk_tier")

EVENT_STORED = "stored"
EVENT_REMOVED = "removed"

_MAGIC = b"SKVDISK1"
# magic, layout fingerprint, payload checksum, payload bytes, block hash bytes
_HEADER = struct.Struct("<8s16s16sQH")
_SUFFIX = ".kv"
_TMP_SUFFIX = ".tmp"
_LOCK_NAME = ".lock"
_CHECKSUM_BYTES = 16


def file_bytes(block_bytes: int, hash_bytes: int) -> int:
    """Size of the file that holds one block of ``block_bytes`` under a block hash of
    ``hash_bytes`` bytes."""
    return _HEADER.size + hash_bytes + block_bytes


def layout_fingerprint(description: str) -> bytes:
    """16 bytes naming a KV layout (model, dtype, per-layer block shapes)."""
    return hashlib.blake2b(description.encode(), digest_size=16).digest()


def _rank_dir(directory: Path, rank: int) -> Path:
    return directory / f"rank{rank}"


def _name(block_hash: bytes) -> str:
    return block_hash.hex() + _SUFFIX


def _hash_of(name: str) -> bytes | None:
    if not name.endswith(_SUFFIX):
        return None
    try:
        return bytes.fromhex(name[:-len(_SUFFIX)])
    except ValueError:
        return None


def _as_bytes(block_hash: Hashable) -> bytes:
    if isinstance(block_hash, bytes):
        return block_hash
    if isinstance(block_hash, int):
        return block_hash.to_bytes(8, "big", signed=block_hash < 0)
    raise TypeError(f"disk tier: block hash of type {type(block_hash).__name__}")


class DiskTierIndex:
    """Which block hashes have a file; scheduler side, no torch, no file I/O after
    start-up (the worker writes, reads and deletes).

    Like the host tier it treats a planned spill as present at once: the worker runs
    the planned operations in order, and a read of a file whose write failed is
    refused by its checks (missing, short, or a bad checksum), never used.
    """

    def __init__(self, directory: str, capacity_bytes: int, block_bytes: int,
                 hash_bytes: int = 32, ranks: int = 1):
        path = Path(directory)
        if not path.is_absolute():
            raise ValueError(f"disk tier: disk_tier_dir must be an absolute path, got "
                             f"{directory!r}")
        if block_bytes <= 0:
            raise ValueError(f"disk tier: block_bytes must be positive, got {block_bytes}")
        self.file_bytes = file_bytes(block_bytes, hash_bytes)
        self.capacity_blocks = capacity_bytes // self.file_bytes
        if self.capacity_blocks <= 0:
            raise ValueError(
                f"disk tier: disk_tier_bytes={capacity_bytes} holds no block file of "
                f"{self.file_bytes} bytes; raise disk_tier_bytes")
        self.directory = path
        self.block_bytes = block_bytes
        self._lock_fd = _lock_directory(path)
        for rank in range(ranks):
            _rank_dir(path, rank).mkdir(exist_ok=True)
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self._events: list[tuple[str, list[bytes]]] = []
        self.spilled_total_blocks = 0
        self.promoted_total_blocks = 0
        self.refused_total_blocks = 0
        self.evictions_total_blocks = 0
        self._scan(ranks)

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- queries -------------------------------------------------------------------

    @property
    def resident_blocks(self) -> int:
        return len(self._lru)

    @property
    def resident_bytes(self) -> int:
        return len(self._lru) * self.file_bytes

    def lookup(self, block_hashes: Sequence[Hashable], start_block: int) -> int:
        """Consecutive blocks with a file from ``block_hashes[start_block]``;
        side-effect free."""
        hit = 0
        for block_hash in block_hashes[start_block:]:
            if _as_bytes(block_hash) not in self._lru:
                break
            hit += 1
        return hit

    def __contains__(self, block_hash: Hashable) -> bool:
        return _as_bytes(block_hash) in self._lru

    # -- changes -------------------------------------------------------------------

    def plan_spill(self, block_hashes: Sequence[Hashable]) -> tuple[list[bytes], list[bytes]]:
        """(hashes to write, hashes whose files to delete first) for blocks the host
        tier evicts.  Present ones are refreshed, not rewritten; room is made by
        dropping the least recently used files not named here."""
        wanted = [_as_bytes(h) for h in block_hashes]
        protected = set(wanted)
        write: list[bytes] = []
        drop: list[bytes] = []
        for block_hash in wanted:
            if block_hash in self._lru:
                self._lru.move_to_end(block_hash)
                continue
            while len(self._lru) >= self.capacity_blocks:
                victim = next((h for h in self._lru if h not in protected), None)
                if victim is None:
                    break
                del self._lru[victim]
                drop.append(victim)
            if len(self._lru) >= self.capacity_blocks:
                break
            self._lru[block_hash] = None
            write.append(block_hash)
        if drop:
            self._events.append((EVENT_REMOVED, drop))
            self.evictions_total_blocks += len(drop)
        if write:
            self._events.append((EVENT_STORED, write))
            self.spilled_total_blocks += len(write)
        return write, drop

    def touch(self, block_hashes: Sequence[Hashable]) -> None:
        for block_hash in block_hashes:
            key = _as_bytes(block_hash)
            if key in self._lru:
                self._lru.move_to_end(key)

    def promoted(self, block_hashes: Sequence[Hashable]) -> None:
        """The worker read these back into host slots (the files stay)."""
        self.touch(block_hashes)
        self.promoted_total_blocks += len(block_hashes)

    def refused(self, block_hashes: Sequence[Hashable]) -> list[bytes]:
        """The worker refused these files (missing, corrupt, another layout) and
        deleted them; forget them.  Returns those that were indexed."""
        removed = [key for key in map(_as_bytes, block_hashes) if self._lru.pop(key, 1) is None]
        self.refused_total_blocks += len(block_hashes)
        if removed:
            self._events.append((EVENT_REMOVED, removed))
        return removed

    def take_events(self) -> list[tuple[str, list[bytes]]]:
        events, self._events = self._events, []
        return events

    # -- start-up ------------------------------------------------------------------

    def _scan(self, ranks: int) -> None:
        """Index the files a previous run left in rank 0's directory, oldest first;
        remove temporary files and files of the wrong size (every rank)."""
        found: list[tuple[float, bytes]] = []
        for rank in range(ranks):
            with os.scandir(_rank_dir(self.directory, rank)) as entries:
                for entry in entries:
                    if entry.name.endswith(_TMP_SUFFIX):
                        _remove(entry.path)
                        continue
                    block_hash = _hash_of(entry.name)
                    if block_hash is None:
                        continue
                    stat = entry.stat()
                    if stat.st_size != file_bytes(self.block_bytes, len(block_hash)):
                        _remove(entry.path)
                    elif rank == 0:
                        found.append((stat.st_mtime, block_hash))
        found.sort()
        excess = max(0, len(found) - self.capacity_blocks)
        for _, block_hash in found[:excess]:
            for rank in range(ranks):
                _remove(_rank_dir(self.directory, rank) / _name(block_hash))
        for _, block_hash in found[excess:]:
            self._lru[block_hash] = None
        if found:
            logger.info("disk tier: %d block files from an earlier run indexed, %d over "
                        "the cap removed (%s)", len(found) - excess, excess, self.directory)


def _lock_directory(path: Path) -> int:
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise ValueError(f"disk tier: cannot use disk_tier_dir {str(path)!r}: {exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise ValueError(f"disk tier: disk_tier_dir {str(path)!r} is in use by another "
                         "engine; give each engine its own directory") from None
    probe = path / f".probe.{os.getpid()}{_TMP_SUFFIX}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        os.close(fd)
        raise ValueError(f"disk tier: disk_tier_dir {str(path)!r} is not writable: "
                         f"{exc}") from None
    return fd


def _remove(path: str | Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class DiskBlockStore:
    """Block files of one worker (its rank's directory); worker side.

    ``pool`` gives and takes a host slot's bytes (``HostBlockPool.read_slot`` and
    ``write_slot``).  Reads and writes are synchronous, on the step that plans them.
    """

    def __init__(self, directory: str, rank: int, fingerprint: bytes,
                 pool: HostBlockPool) -> None:
        if len(fingerprint) != 16:
            raise ValueError("disk tier: the layout fingerprint must be 16 bytes")
        self.directory = _rank_dir(Path(directory), rank)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint
        self._pool = pool
        # Host slots a failed read left with other content: never spilled under the
        # hash that read was for (the scheduler forgets the hash on the report).
        self._bad_slots: set[int] = set()
        self.spilled_total_blocks = 0
        self.promoted_total_blocks = 0
        self.refused_total_blocks = 0

    def path(self, block_hash: bytes) -> Path:
        return self.directory / _name(block_hash)

    def spill(self, slot: int, block_hash: bytes) -> bool:
        """Write host slot ``slot`` as the file of ``block_hash`` (temporary file,
        then rename).  False when the slot is bad or the write failed."""
        if slot in self._bad_slots:
            return False
        payload = self._pool.read_slot(slot)
        checksum = hashlib.blake2b(payload, digest_size=_CHECKSUM_BYTES).digest()
        header = _HEADER.pack(_MAGIC, self.fingerprint, checksum, len(payload),
                              len(block_hash))
        target = self.path(block_hash)
        tmp = target.with_name(f"{target.name}.{os.getpid()}{_TMP_SUFFIX}")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(block_hash)
                f.write(payload)
            os.replace(tmp, target)
        except OSError as exc:
            _remove(tmp)
            logger.warning("disk tier: spill of block %s failed: %s", block_hash.hex(), exc)
            return False
        self.spilled_total_blocks += 1
        return True

    def promote(self, block_hash: bytes, slot: int) -> bool:
        """Read the file of ``block_hash`` into host slot ``slot`` if every check
        passes; else delete the file, leave the slot untouched, and return False."""
        path = self.path(block_hash)
        why = self._check(path, block_hash)
        if isinstance(why, str):
            logger.warning("disk tier: refused block file %s: %s", path.name, why)
            _remove(path)
            self._bad_slots.add(slot)
            self.refused_total_blocks += 1
            return False
        self._pool.write_slot(slot, why)
        self._bad_slots.discard(slot)
        self.promoted_total_blocks += 1
        return True

    def stored_into(self, slots: Sequence[int]) -> None:
        """A host store wrote these slots: their content is good again."""
        self._bad_slots.difference_update(slots)

    def drop(self, block_hash: bytes) -> None:
        _remove(self.path(block_hash))

    def _check(self, path: Path, block_hash: bytes) -> bytes | str:
        """The payload, or why the file is refused."""
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return "missing"
        except OSError as exc:
            return f"unreadable ({exc})"
        if len(data) < _HEADER.size:
            return "short header"
        magic, fingerprint, checksum, payload_bytes, hash_bytes = _HEADER.unpack_from(data)
        if magic != _MAGIC:
            return "not a sessionkv block file"
        if fingerprint != self.fingerprint:
            return "another model or KV layout"
        start = _HEADER.size + hash_bytes
        if data[_HEADER.size:start] != block_hash:
            return "holds another block"
        if payload_bytes != self._pool.block_bytes or len(data) != start + payload_bytes:
            return "wrong length"
        payload = data[start:]
        if hashlib.blake2b(payload, digest_size=_CHECKSUM_BYTES).digest() != checksum:
            return "checksum mismatch"
        return payload
