"""The committed elastic state on disk, on one process: a private directory and
file (0700/0600 whatever the umask), refused when another user owns them or
others can write them (HVDLITE_ELASTIC_TRUST_DIR opts out), a format that
cannot run code (a planted pickle is never executed), arrays, tensors and plain
values back bit for bit, truncated or corrupted files refused by a StateError,
and a full disk that leaves the previous commit standing."""
from __future__ import annotations

import errno
import logging
import os
import pickle
import stat
from collections import OrderedDict
from fractions import Fraction
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from hvdlite.api import runtime
from hvdlite.config import Config
from hvdlite.elastic import codec, persist
from hvdlite.elastic.state import ObjectState
from hvdlite.errors import StateError, StateWriteError

torch = pytest.importorskip("torch")

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


class Plant:
    """Unpickling this creates ``path``: what a planted state would do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (open, (str(self.path), "w"))


def _entries(**values: Any) -> dict[str, codec.Encoded]:
    return {name: codec.encode(value, name) for name, value in values.items()}


def _load(directory: Path, trust: bool = False) -> tuple[dict[str, Any], int]:
    found = persist.read(str(directory), trust=trust)
    assert found is not None
    entries, commits = found
    return {name: codec.decode(e) for name, e in entries.items()}, commits


@pytest.fixture
def umask_zero() -> Iterator[None]:
    previous = os.umask(0)          # the loosest umask: modes come from hvdlite alone
    try:
        yield
    finally:
        os.umask(previous)


def test_new_directory_is_0700_and_file_0600_whatever_the_umask(
        tmp_path: Path, umask_zero: None) -> None:
    directory = tmp_path / "jobs" / "state"
    persist.write(str(directory), _entries(step=1), commits=1)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE(persist.state_path(str(directory)).stat().st_mode) == 0o600
    assert _load(directory) == ({"step": 1}, 1)


def test_existing_directory_keeps_its_mode_and_the_file_is_0600(
        tmp_path: Path, umask_zero: None) -> None:
    tmp_path.chmod(0o711)
    persist.write(str(tmp_path), _entries(step=1), commits=1)
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o711
    assert stat.S_IMODE(persist.state_path(str(tmp_path)).stat().st_mode) == 0o600


@as_root
@pytest.mark.parametrize("what", ["file", "directory"])
def test_state_owned_by_another_user_is_refused_naming_owner_mode_and_fix(
        tmp_path: Path, what: str) -> None:
    persist.write(str(tmp_path), _entries(step=1), commits=1)
    target = persist.state_path(str(tmp_path)) if what == "file" else tmp_path
    os.chown(target, NOBODY, -1)
    with pytest.raises(StateError) as caught:
        persist.read(str(tmp_path))
    message = str(caught.value)
    for part in (f"{what} {target}", f"uid {NOBODY}", "mode 0o", "HVDLITE_ELASTIC_TRUST_DIR=1",
                 "rank 0"):
        assert part in message
    assert _load(tmp_path, trust=True) == ({"step": 1}, 1)       # the opt-out


@pytest.mark.parametrize("what, mode", [("directory", 0o770), ("directory", 0o1777),
                                        ("file", 0o620), ("file", 0o602)])
def test_state_others_can_write_is_refused(tmp_path: Path, what: str, mode: int) -> None:
    persist.write(str(tmp_path), _entries(step=1), commits=1)
    target = persist.state_path(str(tmp_path)) if what == "file" else tmp_path
    target.chmod(mode)
    with pytest.raises(StateError, match=f"group- or world-writable \\(mode {oct(mode)}"):
        persist.read(str(tmp_path))
    assert _load(tmp_path, trust=True) == ({"step": 1}, 1)


def test_an_insecure_directory_is_refused_before_anything_was_committed(tmp_path: Path) -> None:
    tmp_path.chmod(0o777)           # found at the start of the job, not after a crash
    with pytest.raises(StateError, match="chmod go-w"):
        persist.read(str(tmp_path))


def test_trust_variable_reaches_load_persisted(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    persist.write(str(tmp_path), _entries(step=7), commits=3)
    tmp_path.chmod(0o775)
    state = ObjectState(lambda value: value, lambda: 0, step=0)
    for trusted in ("0", "1"):
        config = Config.load({"HVDLITE_ELASTIC_DIR": str(tmp_path),
                              "HVDLITE_ELASTIC_TRUST_DIR": trusted})
        monkeypatch.setattr(runtime.RUNTIME, "config", config)
        if trusted == "0":
            with pytest.raises(StateError, match="world-writable"):
                state.load_persisted()
        else:
            assert state.load_persisted() and state.step == 7


def test_a_planted_state_is_never_executed(tmp_path: Path) -> None:
    marker = tmp_path / "planted-code-ran"
    legacy = tmp_path / "state.pkl"             # the old format: a bare pickle
    legacy.write_bytes(pickle.dumps({"format": 1, "commits": 1, "entries": Plant(marker)}))
    legacy.chmod(0o600)
    with pytest.raises(StateError, match="state.pkl.*old pickle format.*rm "):
        persist.read(str(tmp_path))
    persist.write(str(tmp_path), _entries(step=Plant(marker)), commits=2)   # a $pickle node
    persist.state_path(str(tmp_path)).chmod(0o666)      # anyone could have written it
    with pytest.raises(StateError, match="world-writable"):
        persist.read(str(tmp_path))
    assert not marker.exists()


def test_state_pkl_beside_a_new_state_is_ignored_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    marker = tmp_path / "planted-code-ran"
    (tmp_path / "state.pkl").write_bytes(pickle.dumps(Plant(marker)))
    persist.write(str(tmp_path), _entries(step=1), commits=1)
    logging.getLogger("hvdlite").propagate = True
    with caplog.at_level("WARNING", logger="hvdlite"):
        assert _load(tmp_path) == ({"step": 1}, 1)
    assert "state.pkl" in caplog.text and not marker.exists()


def _same_tensor(a: Any, b: Any) -> bool:
    return (type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape
            and a.requires_grad == b.requires_grad
            and a.detach().contiguous().reshape(-1).view(torch.uint8).tolist()
            == b.detach().contiguous().reshape(-1).view(torch.uint8).tolist())


def test_torch_tensors_come_back_bit_for_bit(tmp_path: Path) -> None:
    torch.manual_seed(0)
    tensors = [torch.randn(3, 5, dtype=torch.bfloat16).t(),            # non-contiguous
               torch.tensor(-0.0, dtype=torch.float16), torch.tensor(float("nan")),
               torch.randn(4, 6)[::2, 1::3], torch.arange(5, dtype=torch.int64),
               torch.tensor([True, False]), torch.zeros(0, 3), torch.randn(2, dtype=torch.complex64),
               torch.nn.Parameter(torch.randn(2, 2)), torch.ones(2, requires_grad=True)]
    persist.write(str(tmp_path), _entries(tensors=tensors), commits=4)
    values, commits = _load(tmp_path)
    assert commits == 4 and len(values["tensors"]) == len(tensors)
    for saved, loaded in zip(tensors, values["tensors"]):
        assert _same_tensor(saved, loaded), (saved, loaded)


def test_numpy_arrays_and_scalars_come_back_bit_for_bit(tmp_path: Path) -> None:
    arrays = [np.arange(12, dtype=">i4").reshape(3, 4)[:, ::2], np.array(np.nan, dtype="f8"),
              np.array(["ab", "c"]), np.zeros((2, 0), "u1"), np.array([1, 2], "datetime64[s]"),
              np.float32(-0.0), np.uint64(2 ** 64 - 1), np.bool_(True)]
    persist.write(str(tmp_path), _entries(arrays=arrays), commits=1)
    loaded = _load(tmp_path)[0]["arrays"]
    for saved, back in zip(arrays, loaded):
        assert type(back) is type(saved) and back.dtype == saved.dtype
        assert back.shape == saved.shape and back.tobytes() == saved.tobytes()
    assert loaded[0].flags.writeable


def test_plain_values_and_a_pickled_fallback_keep_their_types(tmp_path: Path) -> None:
    ordered = OrderedDict(w=1)
    ordered._metadata = OrderedDict({"": {"version": 2}})  # type: ignore[attr-defined]
    plain = {"epoch": 3, "lr": 0.1, "big": 2 ** 80, "none": None, "flag": False,
             "text": "é\n", "nested": [{"a": [1, (2, 3.5)]}, []], 1: "int key",
             (1, "t"): "tuple key", "$tag": "dollar key", "inf": float("-inf"),
             "bytes": b"\x00\xff", "ordered": ordered}
    fallback = {"fraction": Fraction(1, 3), "set": {1, 2}}
    persist.write(str(tmp_path), _entries(plain=plain, fallback=fallback), commits=2)
    values, _ = _load(tmp_path)
    assert values["plain"] == plain and values["fallback"] == fallback
    assert type(values["plain"]["nested"][0]["a"][1]) is tuple
    assert values["plain"]["ordered"]._metadata == {"": {"version": 2}}
    header = persist.state_path(str(tmp_path)).read_bytes()
    assert b'["epoch",3]' in header and b'"$pickle"' in header  # plain values stay JSON
    assert codec.encode({"epoch": 3, "lr": [0.5]}, "x") == codec.Encoded({"epoch": 3,
                                                                          "lr": [0.5]}, ())


def test_a_value_that_cannot_be_stored_is_named() -> None:
    import threading
    with pytest.raises(StateError, match=r"'extra'.*extra\['lock'\] is a lock"):
        codec.encode({"lock": threading.Lock()}, "extra")


def _committed(tmp_path: Path) -> bytes:
    persist.write(str(tmp_path), _entries(model=torch.arange(64.0), step=5), commits=5)
    return persist.state_path(str(tmp_path)).read_bytes()


@pytest.mark.parametrize("cut", [0, 5, 20, 60, -40, -33, -1])
def test_a_truncated_file_is_refused(tmp_path: Path, cut: int) -> None:
    content = _committed(tmp_path)
    persist.state_path(str(tmp_path)).write_bytes(content[:cut % len(content)])
    with pytest.raises(StateError, match=f"cannot read the committed state .*{persist.FILE_NAME}.*"
                                         "Delete it to start over"):
        persist.read(str(tmp_path))


@pytest.mark.parametrize("where", ["magic", "header", "buffer", "digest", "appended"])
def test_a_corrupted_file_is_refused(tmp_path: Path, where: str) -> None:
    content = bytearray(_committed(tmp_path))
    if where == "appended":
        content += b"\0"
    else:
        offset = {"magic": 0, "header": 30, "buffer": len(content) - 100,
                  "digest": len(content) - 1}[where]
        content[offset] ^= 0x01
    persist.state_path(str(tmp_path)).write_bytes(bytes(content))
    with pytest.raises(StateError, match="cannot read the committed state"):
        persist.read(str(tmp_path))


def _rewritten(tmp_path: Path, header: bytes, buffers: bytes = b"") -> None:
    """A file with a valid digest around ``header``: only the parser can catch it."""
    import hashlib
    body = persist.MAGIC + len(header).to_bytes(8, "little") + header + buffers
    persist.state_path(str(tmp_path)).write_bytes(body + hashlib.sha256(body).digest())


@pytest.mark.parametrize("header, match", [
    (b"{not json", "header is not JSON"),
    (b'{"format": 1, "commits": 1, "entries": {}}', "not of format 2"),
    (b'{"format": 2, "entries": {}}', "lacks the commit count"),
    (b'{"format": 2, "commits": 1, "entries": {"a": {"tree": 1, "buffers": [-1]}}}',
     "bad buffer lengths"),
])
def test_a_bad_header_is_refused(tmp_path: Path, header: bytes, match: str) -> None:
    _committed(tmp_path)
    _rewritten(tmp_path, header)
    with pytest.raises(StateError, match=match):
        persist.read(str(tmp_path))


def test_a_crafted_tree_is_refused_when_restored(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    _committed(tmp_path)
    _rewritten(tmp_path, b'{"format": 2, "commits": 1, "entries": {"step": {"tree": '
                         b'{"$ndarray": 0, "dtype": "<f8", "shape": [1000]}, "buffers": [8]}}}',
               b"\0" * 8)
    monkeypatch.setattr(runtime.RUNTIME, "config", Config.load({"HVDLITE_ELASTIC_DIR":
                                                                str(tmp_path)}))
    state = ObjectState(lambda value: value, lambda: 0, step=0)
    with pytest.raises(StateError, match=f"{persist.FILE_NAME}: a float64\\[1000\\] array"):
        state.load_persisted()


class _FullDisk:
    """A file whose writes fail with ENOSPC once ``room`` bytes are written."""

    def __init__(self, handle: Any, room: int) -> None:
        self.handle, self.room = handle, room

    def write(self, data: bytes) -> int:
        if len(data) > self.room:
            self.handle.write(data[:self.room])
            self.handle.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.handle.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.handle, name)

    def __enter__(self) -> "_FullDisk":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.handle.close()


def _fill_disk(monkeypatch: pytest.MonkeyPatch, room: int = 100) -> None:
    opened = os.fdopen
    monkeypatch.setattr(persist.os, "fdopen",
                        lambda fd, mode: _FullDisk(opened(fd, mode), room))


def test_a_full_disk_keeps_the_previous_commit_and_no_temporary_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    persist.write(str(tmp_path), _entries(model=torch.ones(100)), commits=1)
    _fill_disk(monkeypatch)
    with pytest.raises(StateWriteError, match=f"{persist.FILE_NAME} \\(No space left on device\\);"
                                              " the previous commit in it stands"):
        persist.write(str(tmp_path), _entries(model=torch.zeros(100)), commits=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [persist.FILE_NAME]
    values, commits = _load(tmp_path)
    assert commits == 1 and torch.equal(values["model"], torch.ones(100))


def test_a_full_disk_raises_at_that_commit_and_a_later_commit_writes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime.RUNTIME, "config",
                        Config.load({"HVDLITE_ELASTIC_DIR": str(tmp_path)}))
    state = ObjectState(lambda value: value, lambda: 0, step=1)
    state.save()
    state._commits = 1
    state.persist()                                 # commit 1 on disk
    with monkeypatch.context() as full:
        _fill_disk(full, room=10)
        state.step = 2
        state.save()
        state._commits = 2
        with pytest.raises(StateWriteError) as caught:
            state.persist()                         # never a warning only: it raises
    assert str(caught.value).startswith(
        "rank 0: commit 2 did not reach the disk: rank 0 could not write the committed "
        f"state {persist.state_path(str(tmp_path))} (No space left on device)")
    assert "HVDLITE_ELASTIC_DIR holds commit 1, which a restart resumes from" in str(caught.value)
    assert _load(tmp_path)[1] == 1
    state.step = 3                                  # a script that caught it goes on:
    state.save()
    state._commits = 3
    state.persist()                                 # the disk has room again
    assert _load(tmp_path) == ({"step": 3}, 3)
