"""Checkpoint folders (megagspo.checkpoint.store): atomic write, manifest + sha256, verification, fallback to
the previous good checkpoint with a message, pruning, stale temporary folders. Pure file-system, fast."""

import json
import os

import pytest

from megagspo.checkpoint import store
from megagspo.checkpoint.store import CheckpointError


def _write(root, step, payload=b"x" * 1000):
    def put(data):
        return lambda p: open(p, "wb").write(data)

    return store.write_checkpoint(str(root), step, {"model.bin": put(payload), "state.json": put(b"{}")})


def test_write_is_atomic_and_manifest_lists_checksums(tmp_path):
    path = _write(tmp_path, 10)
    assert os.path.basename(path) == "step_000010"
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    assert manifest["step"] == 10 and set(manifest["files"]) == {"model.bin", "state.json"}
    assert manifest["files"]["model.bin"]["bytes"] == 1000
    assert manifest["files"]["model.bin"]["sha256"] == store.sha256_file(os.path.join(path, "model.bin"))
    assert store.verify(path) is None
    assert sorted(os.listdir(tmp_path)) == ["step_000010"]  # no temporary folder left behind


def test_failed_write_leaves_no_step_folder(tmp_path):
    def boom(p):
        open(p, "wb").write(b"half")
        raise OSError("disk full")

    _write(tmp_path, 2)
    with pytest.raises(OSError, match="disk full"):
        store.write_checkpoint(str(tmp_path), 3, {"model.bin": boom})
    assert [s for s, _ in store.list_checkpoints(str(tmp_path))] == [2]
    assert store.verify(str(tmp_path / "step_000002")) is None  # the earlier checkpoint is untouched
    # the next write (same process) clears the leftover .tmp folder
    _write(tmp_path, 4)
    assert sorted(os.listdir(tmp_path)) == ["step_000002", "step_000004"]


def test_stale_tmp_of_dead_process_is_removed(tmp_path):
    stale = tmp_path / "step_000007.tmp-999999999"
    stale.mkdir()
    (stale / "model.bin").write_bytes(b"partial")
    _write(tmp_path, 8)
    assert not stale.exists()


@pytest.mark.parametrize("damage, needle", [
    ("truncate", "bytes, the manifest says"),
    ("flip", "sha256"),
    ("no_manifest", "no manifest.json"),
    ("bad_manifest", "manifest.json is unreadable"),
    ("missing_file", "model.bin is missing"),
])
def test_verify_detects_damage(tmp_path, damage, needle):
    path = _write(tmp_path, 2)
    f = os.path.join(path, "model.bin")
    if damage == "truncate":
        os.truncate(f, 500)
    elif damage == "flip":
        data = bytearray(open(f, "rb").read())
        data[10] ^= 0xFF
        open(f, "wb").write(bytes(data))
    elif damage == "no_manifest":
        os.remove(os.path.join(path, "manifest.json"))
    elif damage == "bad_manifest":
        open(os.path.join(path, "manifest.json"), "w").write("{not json")
    else:
        os.remove(f)
    assert needle in store.verify(path)


def test_latest_good_falls_back_and_says_so(tmp_path):
    for step in (2, 4, 6):
        _write(tmp_path, step)
    os.truncate(tmp_path / "step_000006" / "model.bin", 10)
    said = []
    path = store.latest_good(str(tmp_path), say=said.append)
    assert os.path.basename(path) == "step_000004"
    assert len(said) == 1
    assert said[0].startswith("checkpoint step_000006 is corrupt (model.bin has 10 bytes")
    assert said[0].endswith("falling back to step_000004")


def test_all_corrupt_is_an_error_and_empty_is_none(tmp_path):
    assert store.latest_good(str(tmp_path / "nothing")) is None
    _write(tmp_path, 1)
    os.remove(tmp_path / "step_000001" / "manifest.json")
    with pytest.raises(CheckpointError, match="no intact checkpoint"):
        store.latest_good(str(tmp_path), say=lambda m: None)


def test_required_files_must_be_listed(tmp_path):
    path = _write(tmp_path, 1)
    assert "does not list optimizer.safetensors" in store.verify(path, ("optimizer.safetensors",))


def test_prune_keeps_last_k(tmp_path):
    for step in range(0, 12, 2):
        _write(tmp_path, step)
    deleted = store.prune(str(tmp_path), 3)
    assert [s for s, _ in store.list_checkpoints(str(tmp_path))] == [10, 8, 6]
    assert len(deleted) == 3


def test_rewriting_a_step_replaces_it_atomically(tmp_path):
    _write(tmp_path, 5, b"old")
    path = _write(tmp_path, 5, b"new!")
    assert open(os.path.join(path, "model.bin"), "rb").read() == b"new!"
    assert store.verify(path) is None
    assert sorted(os.listdir(tmp_path)) == ["step_000005"]
