"""The disk tier's files (:class:`radixkv.kv.tiers.disk_pool.DiskPool`), on real files under
``tmp_path``:
pages written, saved and read back after a reopen; every kind of damage (a flipped byte, a reused
slot, a truncated data file, a truncated or flipped manifest, a leftover temporary manifest) read
as bad pages or an empty pool, never as other bytes; a directory of another setup refused or
reset; bad arguments refused naming the value; a writer killed with SIGKILL at random moments
leaving a directory that opens and never serves a wrong page; the worker's errors surfacing."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import selectors
import signal
import stat
import struct
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pytest

import radixkv
from radixkv._radixkv import _page_checksum
from radixkv.kv.tiers import disk_pool as disk
from radixkv.kv.tiers import page
from radixkv.kv.tiers.disk_pool import DiskLockedError, DiskMismatchError, DiskPool, check_unlocked

#: Pages of 3000 bytes: slots of round_up(128 + 3000, 4096) = 4096 bytes.
PB = 3000
SB = 4096
N = 16
FP = {"model": "tiny-llama", "dtype": "float16", "page_size": 16, "layout": "NHD"}

#: Runs before a child's code: torch made unimportable, and ``radixkv.kv`` a bare package (its
#: ``__init__`` imports the torch layer), so the child imports ``radixkv.kv.tiers.disk_pool``
#: alone, fast, and proves that it needs no torch.
CHILD_PRELUDE = """
import os, sys, types
sys.modules["torch"] = None
import radixkv
_kv = types.ModuleType("radixkv.kv")
_kv.__path__ = [os.path.join(os.path.dirname(radixkv.__file__), "kv")]
sys.modules["radixkv.kv"] = _kv
"""


def key(i: int | str) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=32).digest()


def payload(k: bytes, page_bytes: int = PB) -> np.ndarray:
    """The page of key ``k``: a deterministic function of the key."""
    rng = np.random.default_rng(int.from_bytes(k[:8], "little"))
    return rng.integers(0, 256, page_bytes, dtype=np.uint8)


def open_pool(path, num_pages: int = N, page_bytes: int = PB, fingerprint=None, **kw) -> DiskPool:
    # Without the header scan unless asked: these tests pin down the manifest's own rules.
    kw.setdefault("recover", False)
    return DiskPool(path, num_pages, page_bytes, FP if fingerprint is None else fingerprint, **kw)


def filled(path, slots=range(N), save: bool = True) -> tuple[bytes, np.ndarray]:
    """Writes the page of key(s) into each slot s of a fresh pool at ``path``, saves them (all
    of them) and closes; returns what was saved."""
    slots = np.array(list(slots), np.uint32)
    keys = b"".join(key(int(s)) for s in slots)
    with open_pool(path) as pool:
        for s in slots:
            pool.write(int(s), key(int(s)), payload(key(int(s))))
        if save:
            pool.save(keys, slots)
    return keys, slots


def read_all(pool: DiskPool, slots) -> list[np.ndarray | None]:
    return pool.read(list(slots), b"".join(key(int(s)) for s in slots))


def good(page: np.ndarray | None, k: bytes) -> bool:
    return page is not None and page.dtype == np.uint8 and np.array_equal(page, payload(k))


def manifest_bytes(
    keys: bytes,
    slots,
    fingerprint=FP,
    num_pages: int = N,
    page_bytes: int = PB,
    slot_bytes: int = SB,
    fmt: int = 1,
) -> bytes:
    """A manifest built from the format's description (not from the module's code)."""
    header = json.dumps(
        {
            "format": fmt,
            "fingerprint": fingerprint,
            "num_pages": num_pages,
            "page_bytes": page_bytes,
            "slot_bytes": slot_bytes,
        }
    ).encode()
    slots = list(slots)
    body = (
        b"RKVMANI1"
        + struct.pack("<I", len(header))
        + header
        + struct.pack("<Q", len(slots))
        + keys
        + b"".join(struct.pack("<I", s) for s in slots)
    )
    return body + _page_checksum(b"radixkv.manifest", body)


def parse_manifest(data: bytes) -> tuple[dict, bytes, list[int]]:
    """A manifest's (JSON header, keys, slots), read by the format's description."""
    assert data[:8] == b"RKVMANI1"
    assert _page_checksum(b"radixkv.manifest", data[:-32]) == data[-32:]
    (hlen,) = struct.unpack_from("<I", data, 8)
    header = json.loads(data[12 : 12 + hlen])
    (n,) = struct.unpack_from("<Q", data, 12 + hlen)
    pos = 20 + hlen
    assert len(data) == pos + 36 * n + 32
    slots = list(struct.unpack_from(f"<{n}I", data, pos + 32 * n))
    return header, data[pos : pos + 32 * n], slots


def reopen_quietly(path, **kw) -> DiskPool:
    """Opens ``path``, failing on any warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return open_pool(path, **kw)


# --------------------------------------------------------------------------- round trip


def test_write_save_reopen_reads_the_exact_bytes(tmp_path):
    d = tmp_path / "a" / "b"  # parents created
    slots = np.array([7, 0, 3, 4, 5, 15, 9], np.uint32)  # saved order is not slot order
    keys = b"".join(key(f"p{s}") for s in slots)
    with open_pool(d) as pool:
        assert pool.slot_bytes == SB and pool.num_pages == N and pool.page_bytes == PB
        assert pool.fingerprint == FP and pool.path == str(d)
        assert pool.entries[0] == b"" and len(pool.entries[1]) == 0
        for s in slots:
            pool.write(int(s), key(f"p{s}"), payload(key(f"p{s}")))
        pool.save(keys, slots)
        assert pool.entries[0] == keys and np.array_equal(pool.entries[1], slots)
        st = pool.stats()
        assert st["pages_written"] == 7 and st["bytes_written"] == 7 * (128 + PB)
        assert st["queued"] == 0
    assert sorted(os.listdir(d)) == ["lock", "manifest.bin", "pages.bin"]  # lock: see LOCK_FILE
    assert os.path.getsize(d / "pages.bin") == N * SB
    raw = (d / "pages.bin").read_bytes()
    s0 = int(slots[0]) * SB  # the slot layout, byte for byte
    k0 = key(f"p{slots[0]}")
    assert raw[s0 : s0 + 8] == b"RKVPAGE1" and raw[s0 + 8 : s0 + 40] == k0
    setup = raw[s0 + 80 : s0 + 112]
    assert setup == pool.setup and len(setup) == 32
    assert raw[s0 + 40 : s0 + 72] == _page_checksum(k0 + setup, payload(k0))
    assert struct.unpack_from("<Q", raw, s0 + 72)[0] == PB and raw[s0 + 112 : s0 + 128] == bytes(16)
    assert raw[s0 + 128 : s0 + 128 + PB] == payload(k0).tobytes()
    header, got_keys, got_slots = parse_manifest((d / "manifest.bin").read_bytes())
    assert header == {
        "format": 1,
        "fingerprint": FP,
        "num_pages": N,
        "page_bytes": PB,
        "slot_bytes": SB,
    }
    assert got_keys == keys and got_slots == slots.tolist()

    pool = reopen_quietly(d)
    try:
        got_keys, got_slots = pool.entries
        assert got_keys == keys and got_slots.dtype == np.uint32
        assert got_slots.tolist() == slots.tolist()
        pages = pool.read(got_slots, got_keys)
        assert len(pages) == 7
        for i, s in enumerate(slots):
            assert good(pages[i], key(f"p{s}")), f"slot {s}"
            assert pages[i].shape == (PB,)
        st = pool.stats()
        assert st["pages_read"] == 7 and st["bad_pages"] == 0 and st["bytes_read"] > 7 * PB
        assert pool.read([], b"") == []
        assert "DiskPool(" in repr(pool) and str(d) in repr(pool)
    finally:
        pool.close()
    assert "closed" in repr(pool)


def test_the_page_format_module_reads_and_makes_the_slots_the_pool_writes(tmp_path):
    filled(tmp_path, slots=[2, 5], save=False)
    raw = (tmp_path / "pages.bin").read_bytes()
    for s in (2, 5):
        at = s * page.slot_bytes_for(PB)
        magic, k, checksum, length, setup = page.unpack_header(raw, at)
        assert (magic, k, length) == (page.PAGE_MAGIC, key(s), PB)
        assert checksum == _page_checksum(k + setup, payload(k))
        head = page.pack_header(magic, k, checksum, length, setup)
        assert head == raw[at : at + page.HEADER] and head[page.HEADER_STRUCT.size :] == bytes(16)
    assert page.slot_bytes_for(PB) == SB and page.slot_bytes_for(np.int64(1)) == page.ALIGN
    for bad in (0, -1, 1.0, True, "8"):
        with pytest.raises(ValueError, match=f"page_bytes must be a positive int, got {bad!r}"):
            page.slot_bytes_for(bad)
    with pytest.raises(ValueError, match="key must be 32 bytes, got 3 bytes"):
        page.check_key(b"abc")


def test_the_paths_the_docs_named_still_lead_to_the_tiers(tmp_path):
    import radixkv.kv
    from radixkv.kv import tiers

    assert radixkv.kv.disk.check_unlocked is check_unlocked is tiers.check_unlocked
    assert radixkv.kv.disk.DiskPool is DiskPool is tiers.DiskPool
    assert radixkv.kv.DiskMismatchError is DiskMismatchError
    with open_pool(tmp_path), pytest.raises(DiskLockedError, match="is in use by process"):
        radixkv.kv.check_unlocked(str(tmp_path))


def test_manifest_built_from_the_format_description_is_accepted(tmp_path):
    filled(tmp_path, save=False)
    keys = key(3) + key(1)
    (tmp_path / "manifest.bin").write_bytes(manifest_bytes(keys, [3, 1]))
    with reopen_quietly(tmp_path) as pool:
        assert pool.entries[0] == keys and pool.entries[1].tolist() == [3, 1]
        a, b = pool.read([3, 1], keys)
        assert good(a, key(3)) and good(b, key(1))


def test_runs_of_consecutive_slots_are_read_with_one_pread_each(tmp_path, monkeypatch):
    filled(tmp_path)
    calls = []
    real = disk._pread_into

    def counting(fd, buf, offset):
        calls.append((offset, buf.nbytes))
        return real(fd, buf, offset)

    monkeypatch.setattr(disk, "_pread_into", counting)
    with open_pool(tmp_path) as pool:
        order = [0, 1, 2, 5, 6, 9, 3, 3]
        pages = read_all(pool, order)
        assert all(good(p, key(s)) for p, s in zip(pages, order))
    assert [o // SB for o, _ in calls] == [0, 5, 9, 3, 3]
    assert calls[0][1] == 2 * SB + 128 + PB  # three slots, the last one without its padding


# --------------------------------------------------------------------------- damaged pages


@pytest.mark.parametrize(
    "where",
    [128 + 1234, 128 + PB - 1, 0, 8 + 5, 40 + 31, 72],
    ids=["payload", "payload-last", "magic", "key", "checksum", "length"],
)
def test_one_flipped_byte_makes_that_page_bad_and_only_it(tmp_path, where):
    filled(tmp_path)
    with open(tmp_path / "pages.bin", "r+b") as f:
        f.seek(5 * SB + where)
        b = f.read(1)
        f.seek(5 * SB + where)
        f.write(bytes([b[0] ^ 0x40]))
    with reopen_quietly(tmp_path) as pool:
        pages = read_all(pool, [4, 5, 6])
        assert good(pages[0], key(4)) and good(pages[2], key(6))
        assert pages[1] is None
        assert pool.bad_pages == 1 and pool.stats()["bad_pages"] == 1
        assert pool.pages_read == 3


def test_slot_overwritten_after_save_reads_bad_with_the_saved_key(tmp_path):
    keys, _ = filled(tmp_path)
    with reopen_quietly(tmp_path) as pool:
        pool.write(5, key("reuse"), payload(key("reuse")))  # the index reused slot 5, no save
    with reopen_quietly(tmp_path) as pool:
        assert pool.entries[0] == keys  # the manifest still says slot 5 holds key(5)
        old, new, other = pool.read([5, 5, 6], key(5) + key("reuse") + key(6))
        assert old is None
        assert good(new, key("reuse")) and good(other, key(6))
        assert pool.bad_pages == 1


@pytest.mark.parametrize("cut", [0, N // 2 * SB, 5 * SB + 1000], ids=["zero", "half", "mid-slot"])
def test_truncated_data_file_is_extended_and_the_lost_slots_read_bad(tmp_path, cut):
    keys, slots = filled(tmp_path)
    os.truncate(tmp_path / "pages.bin", cut)
    with reopen_quietly(tmp_path) as pool:
        assert os.path.getsize(tmp_path / "pages.bin") == N * SB
        assert pool.entries[0] == keys
        pages = pool.read(slots, keys)
        intact = cut // SB  # slots wholly before the cut
        for s, p in zip(slots.tolist(), pages):
            if s < intact:
                assert good(p, key(s)), f"slot {s} before the cut"
            else:
                assert p is None, f"slot {s} past the cut"
        assert pool.bad_pages == N - intact
        # The lost slots take new pages again.
        pool.write(N - 1, key("again"), payload(key("again")))
        assert good(pool.read([N - 1], key("again"))[0], key("again"))


def test_data_file_shortened_under_an_open_pool_reads_bad(tmp_path):
    filled(tmp_path)
    with reopen_quietly(tmp_path) as pool:
        assert all(good(p, key(s)) for p, s in zip(read_all(pool, [4, 5, 6]), [4, 5, 6]))
        os.truncate(tmp_path / "pages.bin", 5 * SB + 1000)  # slot 5 torn, slot 6 gone
        pages = read_all(pool, [4, 5, 6])
        assert good(pages[0], key(4)) and pages[1:] == [None, None]
        assert pool.bytes_read == (2 * SB + 128 + PB) + (SB + 1000)  # the second read is short


def test_save_makes_the_pages_durable_before_it_replaces_the_manifest(tmp_path, monkeypatch):
    events: list[str] = []
    real_write, real_fsync, real_replace = disk._pwrite_all, os.fsync, os.replace

    def slow_write(fd, header, data, offset):
        time.sleep(0.1)
        events.append(f"page {offset // SB}")
        return real_write(fd, header, data, offset)

    with open_pool(tmp_path) as pool:
        data_fd = pool._fd_box[0]

        def fsync(fd):
            st, tmps = os.fstat(fd), list(tmp_path.glob("manifest.bin.tmp.*"))
            if fd == data_fd:
                events.append("fsync data")
            elif stat.S_ISDIR(st.st_mode) and os.path.samestat(st, os.stat(tmp_path)):
                events.append("fsync dir")
            elif len(tmps) == 1 and os.path.samestat(st, os.stat(tmps[0])):
                events.append("fsync manifest.bin.tmp")
            else:
                events.append(f"fsync another file {fd}")
            return real_fsync(fd)

        def replace(src, dst):
            name = os.path.basename(src)
            if name.startswith("manifest.bin.tmp."):  # each writer's own name
                name = "manifest.bin.tmp"
            events.append(f"replace {name} {os.path.basename(dst)}")
            return real_replace(src, dst)

        monkeypatch.setattr(disk, "_pwrite_all", slow_write)
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)
        pool.write(2, key(2), payload(key(2)))
        pool.save(key(2), [2])
        assert pool.queued == 0 and pool.pages_written == 1
        assert events == [
            "page 2",
            "fsync data",
            "fsync manifest.bin.tmp",
            "replace manifest.bin.tmp manifest.bin",
            "fsync dir",
        ]


# --------------------------------------------------------------------------- damaged manifest


def _damaged_opens_empty(path) -> DiskPool:
    with pytest.warns(RuntimeWarning, match=r"index \(manifest\.bin\) was damaged") as rec:
        pool = open_pool(path)
    assert "starts empty" in str(rec[0].message)
    assert pool.entries[0] == b"" and len(pool.entries[1]) == 0
    return pool


def test_truncated_or_flipped_manifest_opens_empty_with_a_warning(tmp_path):
    filled(tmp_path)
    good_manifest = (tmp_path / "manifest.bin").read_bytes()
    size = len(good_manifest)
    rng = np.random.default_rng(1)
    lengths = [0, 1, 7, 8, 12, 20, size - 33, size - 32, size - 1]
    lengths += rng.integers(0, size, 4).tolist()
    for n in lengths:
        (tmp_path / "manifest.bin").write_bytes(good_manifest[:n])
        _damaged_opens_empty(tmp_path).close()
    flips = [0, 9, 20, size - 32 - N * 4 - 1, size - 32 - 3, size - 1]  # magic .. checksum
    flips += rng.integers(0, size, 4).tolist()
    for i in flips:
        bad = bytearray(good_manifest)
        bad[i] ^= 0x01
        (tmp_path / "manifest.bin").write_bytes(bytes(bad))
        with _damaged_opens_empty(tmp_path) as pool:
            # The data file is still usable.
            assert good(pool.read([2], key(2))[0], key(2))
    (tmp_path / "manifest.bin").write_bytes(good_manifest)
    with reopen_quietly(tmp_path) as pool:
        assert len(pool.entries[1]) == N


@pytest.mark.parametrize(
    "keys,slots",
    [
        (key(1) + key(2), [1, 1]),  # a slot twice
        (key(1) + key(1), [1, 2]),  # a key twice
        (key(1) + key(2), [1, N]),  # a slot past num_pages
    ],
    ids=["dup-slot", "dup-key", "slot-range"],
)
def test_manifest_with_invalid_entries_is_damaged(tmp_path, keys, slots):
    filled(tmp_path, save=False)
    (tmp_path / "manifest.bin").write_bytes(manifest_bytes(keys, slots))  # a valid checksum
    _damaged_opens_empty(tmp_path).close()


def test_leftover_temporary_manifest_is_ignored_and_removed(tmp_path):
    keys, slots = filled(tmp_path)
    (tmp_path / "manifest.bin.tmp").write_bytes(b"RKVMANI1 half-written garbage" * 7)
    with reopen_quietly(tmp_path) as pool:
        assert not (tmp_path / "manifest.bin.tmp").exists()
        assert pool.entries[0] == keys and pool.entries[1].tolist() == slots.tolist()
        assert all(good(p, key(s)) for p, s in zip(pool.read(slots, keys), slots.tolist()))
        pool.save(keys[:32], slots[:1])
        assert not (tmp_path / "manifest.bin.tmp").exists()
    with reopen_quietly(tmp_path) as pool:
        assert pool.entries[0] == keys[:32]


# --------------------------------------------------------------------------- one writer


def test_a_second_opener_in_this_process_is_refused_naming_the_holder(tmp_path):
    keys, slots = filled(tmp_path)
    with reopen_quietly(tmp_path) as first:
        with pytest.raises(DiskLockedError) as e:
            open_pool(tmp_path)
        assert isinstance(e.value, radixkv.Error)
        assert f"process {os.getpid()} on " in str(e.value), str(e.value)
        assert e.value.holder["pid"] == os.getpid()
        # Refusing changed nothing: the holder goes on, its pages and manifest whole.
        first.save(keys, slots)
        assert all(good(p, key(s)) for p, s in zip(first.read(slots, keys), slots.tolist()))
    with reopen_quietly(tmp_path) as pool:  # closing ended the lock
        assert pool.entries[0] == keys


def test_a_second_process_on_the_directory_is_refused_until_the_first_exits(tmp_path):
    filled(tmp_path)
    code = CHILD_PRELUDE + (
        "from radixkv.kv.tiers.disk_pool import DiskPool\n"
        f"pool = DiskPool({str(tmp_path)!r}, {N}, {PB}, {FP!r}, recover=False)\n"
        "print('open', flush=True)\n"
        "sys.stdin.read()\n"
        "pool.save(b'', [])\n"
        "pool.close()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "open"
        with pytest.raises(DiskLockedError, match=rf"in use by process {child.pid} on "):
            open_pool(tmp_path)
        # Asking without opening (a server, before it loads its model) says the same.
        with pytest.raises(DiskLockedError, match=rf"in use by process {child.pid} on "):
            check_unlocked(str(tmp_path))
        child.stdin.close()
        assert child.wait(60) == 0
    finally:
        if child.poll() is None:
            child.kill()
    check_unlocked(str(tmp_path))  # the lock ended with the child
    check_unlocked(str(tmp_path / "not-made-yet"))
    with reopen_quietly(tmp_path) as pool:  # the child's save, whole
        assert pool.entries[0] == b""


def test_each_save_writes_a_temporary_of_its_own(tmp_path, monkeypatch):
    """Two writers never share a temporary manifest (one removing or replacing the other's
    was how a second process made the first one's save fail)."""
    names: list[str] = []
    real_replace = os.replace

    def replace(src, dst):
        names.append(os.path.basename(src))
        return real_replace(src, dst)

    keys, slots = filled(tmp_path)
    monkeypatch.setattr(os, "replace", replace)
    with reopen_quietly(tmp_path) as pool:
        pool.save(keys, slots)
        pool.save(keys, slots)
    assert len(set(names)) == 2, names
    assert all(n.startswith(f"manifest.bin.tmp.{os.getpid()}.") for n in names), names
    assert not list(tmp_path.glob("manifest.bin.tmp*"))


# --------------------------------------------------------------------------- another setup


def test_a_nested_fingerprint_names_the_inner_fields_that_differ(tmp_path):
    config = {"hidden_size": 576, "rope_theta": 10000.0, "num_hidden_layers": 30}
    with DiskPool(tmp_path, N, PB, {"model": {"config": config, "weights": "ab"}}) as pool:
        pool.save(b"", [])
    other = {"model": {"config": {**config, "rope_theta": 500000.0}, "weights": "ab"}}
    with pytest.raises(DiskMismatchError) as e:
        DiskPool(tmp_path, N, PB, other)
    path = "fingerprint['model']['config']['rope_theta']"
    assert e.value.differences == {path: ("10000.0", "500000.0")}
    assert "hidden_size" not in str(e.value), "only the field that differs is named"


def test_another_fingerprint_is_refused_naming_the_fields(tmp_path):
    keys, _ = filled(tmp_path)
    other = {**FP, "dtype": "bfloat16", "weights": "abc123"}
    del other["layout"]
    with pytest.raises(DiskMismatchError) as e:
        open_pool(tmp_path, fingerprint=other)
    assert isinstance(e.value, radixkv.Error)
    msg = str(e.value)
    assert "fingerprint['dtype']" in msg and '"float16"' in msg and '"bfloat16"' in msg
    assert "fingerprint['weights']" in msg and "abc123" in msg
    assert "fingerprint['layout']" in msg and '"NHD"' in msg
    assert "fingerprint['model']" not in msg  # only the fields that differ
    assert 'on_mismatch="reset"' in msg and "another directory" in msg
    assert e.value.differences["fingerprint['dtype']"] == ('"float16"', '"bfloat16"')
    # Refusing changed nothing.
    with reopen_quietly(tmp_path) as pool:
        assert pool.entries[0] == keys


def test_fingerprint_compares_values_exactly(tmp_path):
    filled(tmp_path)
    with pytest.raises(DiskMismatchError, match=r"fingerprint\['page_size'\]: stored 16, given"):
        open_pool(tmp_path, fingerprint={**FP, "page_size": 16.5})
    with pytest.raises(DiskMismatchError, match="stored 16, given true"):
        open_pool(tmp_path, fingerprint={**FP, "page_size": True})
    # A tuple is stored as a JSON list and compares equal to one.
    with DiskPool(tmp_path / "t2", N, PB, {"shape": (1, 2)}) as pool:
        pool.save(b"", [])
    with reopen_quietly(tmp_path / "t2", fingerprint={"shape": [1, 2]}) as pool:
        assert pool.fingerprint == {"shape": [1, 2]}


def test_reset_on_another_fingerprint_warns_and_starts_empty(tmp_path):
    keys, slots = filled(tmp_path)
    other = {**FP, "dtype": "bfloat16"}
    with pytest.warns(RuntimeWarning, match=r"fingerprint\['dtype'\]"):
        pool = open_pool(tmp_path, fingerprint=other, on_mismatch="reset")
    with pool:
        assert pool.entries[0] == b"" and len(pool.entries[1]) == 0
        assert os.path.getsize(tmp_path / "pages.bin") == N * SB
    # Not saved: the old manifest is still there, and the data file was reused.
    with reopen_quietly(tmp_path) as pool:
        assert pool.entries[0] == keys
        assert all(good(p, key(s)) for p, s in zip(pool.read(slots, keys), slots.tolist()))
    with pytest.warns(RuntimeWarning):
        pool = open_pool(tmp_path, fingerprint=other, on_mismatch="reset")
    with pool:
        pool.save(b"", [])
    with reopen_quietly(tmp_path, fingerprint=other) as pool:
        assert pool.entries[0] == b""
    with pytest.raises(DiskMismatchError):
        open_pool(tmp_path)


@pytest.mark.parametrize(
    "num_pages,page_bytes,fields",
    [
        (2 * N, PB, {"num_pages": (N, 2 * N)}),
        (N // 2, PB, {"num_pages": (N, N // 2)}),
        (N, 5000, {"page_bytes": (PB, 5000), "slot_bytes": (SB, 2 * SB)}),
        (N, 3500, {"page_bytes": (PB, 3500)}),  # the same slot size
    ],
    ids=["more-pages", "fewer-pages", "bigger-pages", "same-slot"],
)
def test_another_layout_is_refused_or_reset(tmp_path, num_pages, page_bytes, fields):
    filled(tmp_path)
    with pytest.raises(DiskMismatchError) as e:
        open_pool(tmp_path, num_pages=num_pages, page_bytes=page_bytes)
    assert e.value.differences == fields
    for name, (stored, given) in fields.items():
        assert f"{name}: stored {stored}, given {given}" in str(e.value)
    assert os.path.getsize(tmp_path / "pages.bin") == N * SB  # refusing changed nothing

    with pytest.warns(RuntimeWarning, match=next(iter(fields))):
        pool = open_pool(tmp_path, num_pages=num_pages, page_bytes=page_bytes, on_mismatch="reset")
    with pool:
        assert pool.entries[0] == b""
        assert os.path.getsize(tmp_path / "pages.bin") == num_pages * pool.slot_bytes
        # Emptied: nothing of the old layout is left to misread.
        assert (tmp_path / "pages.bin").read_bytes()[:8] == bytes(8)
        k = key("new")
        pool.write(0, k, payload(k, page_bytes))
        pool.save(k, [0])
    with reopen_quietly(tmp_path, num_pages=num_pages, page_bytes=page_bytes) as pool:
        assert np.array_equal(pool.read([0], k)[0], payload(k, page_bytes))


def test_another_format_version_is_a_mismatch(tmp_path):
    filled(tmp_path, save=False)
    (tmp_path / "manifest.bin").write_bytes(manifest_bytes(b"", [], fmt=2))
    with pytest.raises(DiskMismatchError, match="format: stored 2, given 1"):
        open_pool(tmp_path)


def test_longer_data_file_without_a_manifest_is_refused(tmp_path):
    filled(tmp_path, save=False)
    with pytest.raises(ValueError, match=r"longer than num_pages=8 .* on_mismatch=\"reset\""):
        open_pool(tmp_path, num_pages=8)
    assert os.path.getsize(tmp_path / "pages.bin") == N * SB  # never shrunk on refusal
    with pytest.warns(RuntimeWarning, match="longer"):
        pool = open_pool(tmp_path, num_pages=8, on_mismatch="reset")
    with pool:
        assert os.path.getsize(tmp_path / "pages.bin") == 8 * SB
        assert read_all(pool, [0, 1]) == [None, None]


# --------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_pages": 0}, "num_pages must be a positive int, got 0"),
        ({"num_pages": -3}, "num_pages .* got -3"),
        ({"num_pages": 2.0}, r"num_pages .* got 2\.0"),
        ({"num_pages": True}, "num_pages .* got True"),
        ({"page_bytes": -1}, "page_bytes must be a positive int, got -1"),
        ({"page_bytes": "8"}, "page_bytes .* got '8'"),
        ({"on_mismatch": "x"}, "on_mismatch .* got 'x'"),
        ({"on_mismatch": None}, "on_mismatch .* got None"),
        ({"fingerprint": {"w": object()}}, "fingerprint must be JSON-serializable"),
        ({"fingerprint": {"x": float("nan")}}, "fingerprint must be JSON-serializable"),
    ],
)
def test_bad_constructor_arguments_name_the_value(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        open_pool(tmp_path / "d", **kwargs)
    assert not (tmp_path / "d").exists()  # refused before anything was created


def test_bad_path_and_fingerprint_types(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a directory"):
        open_pool(tmp_path / "f")
    with pytest.raises(TypeError, match="fingerprint must be a mapping"):
        open_pool(tmp_path, fingerprint=[("a", 1)])


def test_bad_call_arguments_name_the_value_and_queue_nothing(tmp_path):
    with open_pool(tmp_path) as pool:
        k, p = key(1), payload(key(1))
        bad_writes = [
            ((N, k, p), f"slot must be an int in \\[0, num_pages={N}\\), got {N}"),
            ((-1, k, p), "got -1"),
            ((True, k, p), "got True"),
            ((1.0, k, p), r"got 1\.0"),
            ((1, k[:31], p), "key must be 32 bytes, got 31 bytes"),
            ((1, "a" * 32, p), "key must be 32 bytes, got 'aaaa"),
            ((1, k, p[:-1]), f"payload must be page_bytes={PB} bytes, got {PB - 1}"),
            ((1, k, p.astype(np.uint16)), "payload must be a uint8 array, got dtype uint16"),
            ((1, k, p.astype(np.float32)), "dtype float32"),
            ((1, k, np.zeros(2 * PB, np.uint8)[::2]), "C-contiguous"),
            ((1, k, p.tobytes()), "payload must be a numpy uint8 array .* got bytes"),
        ]
        for args, match in bad_writes:
            with pytest.raises(ValueError, match=match):
                pool.write(*args)
        pool.write(1, k, p.reshape(10, PB // 10))  # any C-contiguous shape of page_bytes
        with pytest.raises(ValueError, match=f"slots\\[1\\] = {N} is not a slot"):
            pool.read([1, N], k + k)
        with pytest.raises(ValueError, match=r"slots\[0\] = -2"):
            pool.read(np.array([-2]), k)
        with pytest.raises(ValueError, match="slots must be ints"):
            pool.read([1.5], k)
        with pytest.raises(ValueError, match=r"keys must be 32 bytes per slot .* got 33 bytes"):
            pool.read([1], k + b"x")
        bad_saves = [
            ((k, [1, 2]), "got 32 bytes"),
            ((k + key(2), [2, 2]), "slots must be distinct, got slot 2 twice"),
            ((k + k, [1, 2]), f"keys must be distinct, got key {k.hex()} twice"),
            ((k, [N + 5]), f"= {N + 5} is not a slot"),
            ((k, np.array([[1]])), "1-D"),
        ]
        for args, match in bad_saves:
            with pytest.raises(ValueError, match=match):
                pool.save(*args)
        assert not (tmp_path / "manifest.bin").exists()
        pool.flush()
        assert pool.pages_written == 1 and pool.queued == 0
        assert good(pool.read([1], k)[0], key(1))


def test_closed_pool_refuses_every_call(tmp_path):
    pool = open_pool(tmp_path)
    pool.write(0, key(0), payload(key(0)))
    pool.close()
    pool.close()  # idempotent
    assert pool.closed and pool.pages_written == 1  # the queued write was performed
    for call in (
        lambda: pool.write(0, key(0), payload(key(0))),
        lambda: pool.read([0], key(0)),
        pool.flush,
        lambda: pool.save(b"", []),
    ):
        with pytest.raises(ValueError, match="the DiskPool is closed"):
            call()
    with open_pool(tmp_path) as again:
        assert good(again.read([0], key(0))[0], key(0))
    assert again.closed


# --------------------------------------------------------------------------- the worker


def test_read_right_after_a_queued_write_sees_it(tmp_path, monkeypatch):
    real = disk._pwrite_all

    def slow(*args):
        time.sleep(0.2)
        return real(*args)

    with open_pool(tmp_path) as pool:
        pool.write(3, key("old"), payload(key("old")))
        pool.flush()
        monkeypatch.setattr(disk, "_pwrite_all", slow)
        pool.write(3, key("new"), payload(key("new")))
        assert pool.queued == 1  # still queued when the read starts
        new, old = pool.read([3, 3], key("new") + key("old"))
        assert good(new, key("new")) and old is None
        assert pool.queued == 0


def _failing_writes(monkeypatch) -> threading.Event:
    """Makes every page write fail, once the returned event is set."""
    go = threading.Event()

    def fail(fd, header, data, offset):
        assert go.wait(timeout=30)
        raise OSError(errno.EIO, "injected I/O error")

    monkeypatch.setattr(disk, "_pwrite_all", fail)
    return go


def _until_performed(pool: DiskPool) -> None:
    deadline = time.monotonic() + 30
    while pool.queued and time.monotonic() < deadline:
        time.sleep(0.005)


@pytest.mark.parametrize("first", ["flush", "read", "write", "save"])
def test_an_error_in_the_worker_surfaces_on_the_next_call(tmp_path, monkeypatch, first):
    pool = open_pool(tmp_path)
    pool.write(0, key(0), payload(key(0)))
    pool.flush()
    go = _failing_writes(monkeypatch)
    pool.write(1, key(1), payload(key(1)))
    pool.write(2, key(2), payload(key(2)))  # queued after the one that fails: dropped
    go.set()
    _until_performed(pool)
    calls = {
        "flush": pool.flush,
        "read": lambda: pool.read([0], key(0)),
        "write": lambda: pool.write(3, key(3), payload(key(3))),
        "save": lambda: pool.save(key(0), [0]),
    }
    with pytest.raises(RuntimeError, match="failed writing slot 1") as e:
        calls[first]()
    assert isinstance(e.value.__cause__, OSError) and e.value.__cause__.errno == errno.EIO
    for call in calls.values():  # refuses further use
        with pytest.raises(RuntimeError, match="refuses further use"):
            call()
    assert pool.pages_written == 1 and pool.queued == 0
    assert not (tmp_path / "manifest.bin").exists()
    pool.close()  # reported already: closes quietly
    with pytest.raises(ValueError, match="closed"):
        pool.flush()
    with open_pool(tmp_path) as again:
        assert read_all(again, [0, 1, 2])[1:] == [None, None]


def test_an_unreported_worker_error_is_raised_by_close(tmp_path, monkeypatch):
    _failing_writes(monkeypatch).set()
    pool = open_pool(tmp_path)
    pool.write(4, key(4), payload(key(4)))
    with pytest.raises(RuntimeError, match="failed writing slot 4"):
        pool.close()
    assert pool.closed
    pool.close()
    # In a with block that already raises, the close does not hide that error.
    with pytest.raises(KeyError), open_pool(tmp_path / "w") as p2:
        p2.write(0, key(0), payload(key(0)))
        raise KeyError("the caller's error")


# --------------------------------------------------------------------------- crashes


def test_disk_module_imports_without_torch():
    code = CHILD_PRELUDE + "import radixkv.kv.tiers.disk_pool as d\nprint(d.DiskPool.__name__)\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "DiskPool"


#: A writer that never stops: pages derived from their key, slots reused at random, the
#: current slot -> key map saved every few writes.
WRITER = (
    CHILD_PRELUDE
    + """
import hashlib, json
import numpy as np
from radixkv.kv.tiers.disk_pool import DiskPool

path, trial, num_pages, page_bytes, fp = sys.argv[1:6]
trial, num_pages, page_bytes = int(trial), int(num_pages), int(page_bytes)
pool = DiskPool(path, num_pages, page_bytes, json.loads(fp))
rng = np.random.default_rng(trial)
slot_key = {}
n = 0
print("ready", flush=True)
while True:
    key = hashlib.blake2b(f"{trial}:{n}".encode(), digest_size=32).digest()
    page = np.random.default_rng(int.from_bytes(key[:8], "little")).integers(
        0, 256, page_bytes, dtype=np.uint8
    )
    slot = int(rng.integers(num_pages))
    pool.write(slot, key, page)
    slot_key[slot] = key
    n += 1
    if n % int(rng.integers(1, 8)) == 0:
        slots = sorted(slot_key)
        pool.save(b"".join(slot_key[s] for s in slots), np.array(slots, np.uint32))
"""
)


def test_writer_killed_at_random_never_leaves_a_wrong_page(tmp_path):
    slots_n, trials = 64, 6
    rng = np.random.default_rng(2024)
    good_reads = bad_reads = 0
    fp = json.dumps(FP)
    for trial in range(trials):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path), str(trial), str(slots_n), str(PB), fp],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            sel = selectors.DefaultSelector()
            sel.register(proc.stdout, selectors.EVENT_READ)
            assert sel.select(timeout=30), "the writer did not start"
            line = proc.stdout.readline()
            assert line == b"ready\n", proc.stderr.read().decode() if not line else line
            time.sleep(float(rng.uniform(0.05, 0.5)))
            assert proc.poll() is None, proc.stderr.read().decode()
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        assert proc.returncode == -signal.SIGKILL
        pool = DiskPool(tmp_path, slots_n, PB, FP)  # opens, whatever the kill interrupted
        with pool:
            keys, slots = pool.entries
            assert len(keys) == 32 * len(slots) and len(set(slots.tolist())) == len(slots)
            pages = pool.read(slots, keys)
            for i, page in enumerate(pages):
                k = keys[32 * i : 32 * (i + 1)]
                if page is None:
                    bad_reads += 1
                else:
                    assert np.array_equal(page, payload(k)), f"trial {trial}: a wrong page"
                    good_reads += 1
            assert pool.bad_pages == sum(p is None for p in pages)
    assert good_reads > 0, f"nothing was ever readable ({bad_reads} bad)"


# --------------------------------------------------------------------------- recovery


def test_pages_written_after_the_last_save_are_recovered_from_their_headers(tmp_path):
    with open_pool(tmp_path) as pool:
        for s in range(4):
            pool.write(s, key(s), payload(key(s)))
        pool.save(b"".join(key(s) for s in range(2)), np.arange(2, dtype=np.uint32))
        for s in range(4, 7):  # never saved: a crash now would lose them without the scan
            pool.write(s, key(s), payload(key(s)))
        pool.write(1, key("new1"), payload(key("new1")))  # slot 1 reused after the save
        pool.flush()
    with reopen_quietly(tmp_path, recover=False) as pool:
        assert pool.entries[1].tolist() == [0, 1]  # the manifest alone
    with reopen_quietly(tmp_path, recover=True) as pool:
        keys, slots = pool.entries
        got = {int(s): keys[32 * i : 32 * i + 32] for i, s in enumerate(slots)}
        # The saved entry still in its slot first, then every header of this setup, in slot
        # order; slot 1 names the key written there last.
        assert slots.tolist()[0] == 0
        assert got == {s: key(s) for s in (0, 2, 3, 4, 5, 6)} | {1: key("new1")}
        assert pool.recovered == 6
        pages = pool.read(slots, keys)
        assert all(good(p, got[int(s)]) for p, s in zip(pages, slots))


def test_recovery_ignores_pages_of_another_setup_and_reading_them_is_refused(tmp_path):
    """A process of another model (on_mismatch="reset") writes into the directory and dies
    before saving: its pages have the same keys as ours (the same prompts), valid checksums,
    and are still never this pool's."""
    with open_pool(tmp_path) as pool:
        for s in range(3):
            pool.write(s, key(s), payload(key(s)))
        pool.save(b"".join(key(s) for s in range(3)), np.arange(3, dtype=np.uint32))
    other = {**FP, "weights": "another model"}
    with pytest.warns(RuntimeWarning, match="another setup"):
        intruder = open_pool(tmp_path, fingerprint=other, on_mismatch="reset")
    with intruder:
        intruder.write(1, key(1), payload(key(9)))  # our key, another model's bytes
        intruder.write(5, key(5), payload(key(5)))
        intruder.flush()
    with reopen_quietly(tmp_path, recover=True) as pool:
        _, slots = pool.entries
        assert slots.tolist() == [0, 2]  # slot 1 and slot 5 hold the other setup's pages
        assert pool.read([1], key(1)) == [None]
        assert pool.bad_pages == 1
