"""Hostile files on disk (issue 31 items 3, 4; table in docs/robustness.md, "Files read from disk").

- which weights a run folder holds: `megagspo export`, `model.init_from=<run folder>` and --resume give one
  answer, the current run's newest intact step checkpoint; an earlier run's checkpoint.pt is moved aside by a
  fresh run (--overwrite: the whole earlier run, into one sibling folder) and never read as this run's; a checkpoint pruned while it is read is skipped, not called broken;
- every JSON read from disk goes through one bounded reader (moe/json_files.py): nesting 100,000 deep in an
  HF folder's config.json, safetensors index or generation_config.json, or in a checkpoint's manifest,
  trainer_state.json, model/metadata.json or the KL reference record, is a one-line error naming the file, and
  a corrupt newest checkpoint falls back to the previous one whatever the corruption;
- a Hugging Face folder holding a NaN or infinite weight is refused when the weights are read, naming the
  tensor, before anything is trained or written.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import CliRuns
from multiprocess import cpu_pinned_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = ["threads=1", "log.progress=false", "log.plots=false", "log.tensorboard=false"]
TINY = ["sft.steps=1", "sft.batch_size=4", "rl.prompts_per_step=2", "rl.group_size=2", "rl.mini_batches=1",
        "data.train_size=50", "data.eval_size=5", "checkpoint.every_steps=1", *FAST]
DEEP = "[" * 100_000 + "]" * 100_000


def _env():
    return cpu_pinned_env(OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _cli(*args, timeout=300):
    """A `megagspo` command in a fresh process (the deeply nested inputs: a fresh interpreter's stack)."""
    return subprocess.run([sys.executable, "-m", "megagspo.cli", *args], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """One process for the module's other `megagspo` commands (cli.run(args)): a command costs its work, not a
    fresh start-up."""
    cli_runs = CliRuns(_env(), str(tmp_path_factory.mktemp("cli") / "stderr.log"))
    yield cli_runs
    cli_runs.close()


def _train(cli, out_dir, name, *extra):
    proc = cli.run(["train", "--config", "configs/tiny_cpu.yaml", *TINY, f"log.out_dir={out_dir}", f"name={name}",
                    *extra])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return os.path.join(out_dir, name)


@pytest.fixture(scope="module")
def runs(cli, tmp_path_factory):
    """A finished 2-step run A (checkpoint.pt + step_000000..2), then a fresh run B (another seed) over the same
    folder that stops before writing checkpoint.pt (log.save_checkpoint=false: as if interrupted), and an
    untouched copy of A."""
    out = tmp_path_factory.mktemp("runs")
    first = _train(cli, out, "r", "rl.steps=2")
    shutil.copytree(first, out / "a_only")
    second = _train(cli, out, "r", "rl.steps=1", "seed=5", "log.save_checkpoint=false", "--overwrite")
    return {"out": out, "run": second, "a_only": str(out / "a_only")}


def _same_state(x: dict, y: dict) -> bool:
    return set(x) == set(y) and all(torch.equal(x[k], y[k]) for k in x)


# --------------------------------------------------------------------- item 3: which weights a folder holds
@pytest.mark.slow
def test_a_stale_checkpoint_pt_is_moved_aside_and_never_read(runs):
    from megagspo.checkpoint.full_state import load_checkpoint
    from megagspo.checkpoint.guards import safe_torch_load
    from megagspo.checkpoint.state import load_run_checkpoint, resolve_checkpoint

    run = runs["run"]
    stale = safe_torch_load(os.path.join(runs["a_only"], "checkpoint.pt"))["state"]
    # run B's own newest checkpoint, read from its checkpoints folder directly
    own = load_run_checkpoint(os.path.join(run, "checkpoints", "step_000001"))
    got = load_checkpoint(run)  # what export and model.init_from read
    assert got.get("path") == own["path"] == resolve_checkpoint(run), got.get("path")
    assert _same_state(got["state"], own["state"]) and not _same_state(got["state"], stale)
    # the earlier run went aside whole, into one sibling folder; nothing was deleted
    assert not os.path.exists(os.path.join(run, "checkpoint.pt"))
    out = runs["out"]
    aside = [n for n in os.listdir(out) if n.startswith("r.replaced-")]
    assert len(aside) == 1 and {"checkpoint.pt", "cold_start.pt", "checkpoints", "metrics.jsonl"} <= \
        set(os.listdir(os.path.join(out, aside[0])))
    assert "step_000002" in os.listdir(os.path.join(out, aside[0], "checkpoints"))


@pytest.mark.slow
def test_init_from_and_export_of_the_run_folder_take_the_same_checkpoint(cli, runs, tmp_path):
    from megagspo.config import load_config
    from megagspo.data.tokenizer import BuiltinTokenizer
    from megagspo.policy.init_weights import preflight_init_from

    run = runs["run"]
    cfg = load_config(os.path.join(REPO, "configs/tiny_cpu.yaml"), [*TINY, f"model.init_from={run}"])
    source = preflight_init_from(cfg.model, cfg.model.architecture(BuiltinTokenizer().vocab_size))
    from megagspo.checkpoint.state import load_run_checkpoint

    assert _same_state(source.full_state, load_run_checkpoint(run)["state"])
    proc = cli.run(["export", "--checkpoint", run, "--out", str(tmp_path / "hf")])
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_a_checkpoint_pt_older_than_the_current_run_is_refused(cli, runs, tmp_path):
    """A folder left by the earlier code: a fresh run moved checkpoints/ aside but not checkpoint.pt, and was
    interrupted before its first checkpoint. checkpoint.pt predates config.yaml (rewritten by every run)."""
    folder = tmp_path / "legacy"
    folder.mkdir()
    shutil.copy2(os.path.join(runs["a_only"], "checkpoint.pt"), folder / "checkpoint.pt")
    (folder / "config.yaml").write_text(open(os.path.join(runs["a_only"], "config.yaml")).read())
    proc = cli.run(["export", "--checkpoint", str(folder), "--out", str(tmp_path / "hf")])
    assert proc.returncode == 2 and "left by an earlier run" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "hf").exists()
    # the file itself, named explicitly, is still read
    proc = cli.run(["export", "--checkpoint", str(folder / "checkpoint.pt"), "--out", str(tmp_path / "hf2")])
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("when", ["verify", "read"])
def test_a_checkpoint_pruned_while_exported_is_skipped_not_called_broken(runs, tmp_path, monkeypatch, capsys, when):
    """A trainer still writing the run prunes the checkpoint an export is reading: while its checksums are
    checked, or after that while its shards are read. The export takes the next newest and says why."""
    import megagspo.checkpoint.store as store
    import moe.dist_checkpoint as dist
    from megagspo.checkpoint.full_state import load_checkpoint

    run = tmp_path / "r"
    shutil.copytree(runs["a_only"], run)
    os.remove(run / "checkpoint.pt")
    newest = str(run / "checkpoints" / "step_000002")
    if when == "verify":
        real = store.sha256_file

        def pruning(path, *a, **k):
            if path.startswith(newest) and os.path.isdir(newest):
                shutil.rmtree(newest)
            return real(path, *a, **k)

        monkeypatch.setattr(store, "sha256_file", pruning)
    else:
        real = dist.read_full_state_dict

        def pruning(directory, index):
            if directory.startswith(newest) and os.path.isdir(newest):
                shutil.rmtree(newest)
            return real(directory, index)

        monkeypatch.setattr(dist, "read_full_state_dict", pruning)
    got = load_checkpoint(str(run))
    said = capsys.readouterr().out
    assert got["path"].endswith("step_000001"), got.get("path")
    assert "step_000002 was pruned while being read" in said and "corrupt" not in said, said


# ------------------------------------------------------------ item 4: one bounded reader for every JSON file
def _rewrite_manifest(step_dir: str) -> None:
    """Re-checksum a checkpoint after a file was changed, as a writer that wrote it that way would have."""
    from megagspo.checkpoint import store

    manifest = json.load(open(os.path.join(step_dir, store.MANIFEST)))
    for name in manifest["files"]:
        path = os.path.join(step_dir, name)
        manifest["files"][name] = {"bytes": os.path.getsize(path), "sha256": store.sha256_file(path)}
    with open(os.path.join(step_dir, store.MANIFEST), "w") as f:
        json.dump(manifest, f)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["manifest.json", "trainer_state.json", "model/metadata.json"])
def test_a_deeply_nested_file_in_the_newest_checkpoint_falls_back(runs, tmp_path, target):
    run = tmp_path / "r"
    shutil.copytree(runs["a_only"], run)
    os.remove(run / "checkpoint.pt")
    newest = run / "checkpoints" / "step_000002"
    (newest / target).write_text(DEEP)
    if target != "manifest.json":
        _rewrite_manifest(str(newest))  # checksums agree: only the content is hostile
    # export, and a resume of the same folder (in the dry run's place: a real resume with a run folder)
    proc = _cli("export", "--checkpoint", str(run), "--out", str(tmp_path / "hf"))
    assert "Traceback" not in proc.stderr and "RecursionError" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step_000002 is corrupt" in proc.stdout and "falling back to step_000001" in proc.stdout, proc.stdout
    proc = _cli("train", "--config", "configs/tiny_cpu.yaml", *TINY, "rl.steps=3", f"log.out_dir={tmp_path}",
                "name=r", "--resume")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "resuming from" in proc.stdout and "step_000001" in proc.stdout, proc.stdout[-3000:]


def test_the_reader_bounds_size_depth_and_type(tmp_path):
    from moe.json_files import JsonFileError, read_json

    path = tmp_path / "x.json"
    for text, needle in ((DEEP, "nested deeper than 64"), ('{"a":' * 70 + "1" + "}" * 70, "nested deeper than 64"),
                         ("{not json", "not valid JSON"), ("[1]", "expected a JSON object, got list")):
        path.write_text(text)
        with pytest.raises(JsonFileError) as err:
            read_json(path)
        assert str(path) in str(err.value) and needle in str(err.value) and "\n" not in str(err.value)
    path.write_text(json.dumps({"a": "x" * 1000}))
    with pytest.raises(JsonFileError, match="larger than 100 bytes"):
        read_json(path, max_bytes=100)
    with pytest.raises(JsonFileError, match="cannot be read"):
        read_json(tmp_path / "missing.json")


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    from megagspo.tools.tiny_hf_model import build_tiny_hf_model

    return build_tiny_hf_model(str(tmp_path_factory.mktemp("tiny_hf") / "model"))


def _hf_args(kit, folder, out_dir):
    return ["--config", "configs/tiny_hf_cpu.yaml", f"model.init_from={folder}", f"data.train_path={kit['train']}",
            f"data.eval_path={kit['eval']}", f"log.out_dir={out_dir}", *FAST]


def _sharded(kit, dst):
    """The tiny HF folder as two shards and their index."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(kit["model"], dst)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    os.remove(os.path.join(dst, "model.safetensors"))
    keys = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2:])):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, os.path.join(dst, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return dst


@pytest.mark.slow
@pytest.mark.parametrize("target", ["config.json", "generation_config.json", "model.safetensors.index.json"])
def test_a_deeply_nested_hf_folder_file_is_named_in_one_line(kit, tmp_path, target):
    folder = _sharded(kit, tmp_path / "hf") if target.endswith("index.json") else shutil.copytree(kit["model"],
                                                                                                    tmp_path / "hf")
    with open(os.path.join(folder, target), "w") as f:
        f.write(DEEP)
    proc = _cli("train", "--dry-run", *_hf_args(kit, folder, tmp_path / "runs"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "RecursionError" not in proc.stderr, proc.stderr[-3000:]
    assert os.path.join(str(folder), target) in proc.stderr and "nested deeper than" in proc.stderr, proc.stderr
    assert not (tmp_path / "runs").exists()


def test_a_deeply_nested_kl_reference_record_is_a_clear_error(tmp_path):
    from megagspo.checkpoint import CheckpointError
    from megagspo.checkpoint.reference import REFERENCE, REFERENCE_META, verify_reference

    (tmp_path / REFERENCE).write_bytes(b"x")
    (tmp_path / REFERENCE_META).write_text(DEEP)
    with pytest.raises(CheckpointError, match="nested deeper than"):
        verify_reference(str(tmp_path), "run")


# ------------------------------------------------------------------------------- item 4: non-finite weights
@pytest.mark.slow
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_hf_weights_are_refused_when_read(cli, kit, tmp_path, value):
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(kit["model"], tmp_path / "hf")
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    key = next(k for k in sorted(tensors) if "experts.1.up_proj" in k or "mlp.experts.gate_up_proj" in k)
    tensors[key].view(-1)[7] = value
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    proc = cli.run(["train", *_hf_args(kit, folder, tmp_path / "runs"), "sft.steps=1", "rl.steps=1"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and key in proc.stderr and "NaN or infinite" in proc.stderr, \
        proc.stderr[-3000:]
    assert not any("step_" in d for _, dirs, _ in os.walk(tmp_path / "runs") for d in dirs)


@pytest.mark.slow
def test_non_finite_weights_in_a_megagspo_state_are_refused_by_the_dry_run(cli, runs, tmp_path):
    from safetensors.torch import save_file

    from megagspo.checkpoint.state import load_run_checkpoint

    state = {k: v.clone() for k, v in load_run_checkpoint(runs["run"])["state"].items()}
    key = sorted(state)[3]
    state[key].view(-1)[0] = float("nan")
    save_file(state, str(tmp_path / "w.safetensors"))
    proc = cli.run(["train", "--dry-run", "--config", "configs/tiny_cpu.yaml", *TINY,
                    f"model.init_from={tmp_path / 'w.safetensors'}", f"log.out_dir={tmp_path / 'runs'}"])
    assert proc.returncode == 2 and key in proc.stderr and "NaN or infinite" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


# ----------------------------------------------- non-finite values in the run's own checkpoints and KL reference
def _poison_chunk(sub_dir: str, value: float) -> tuple:
    """Write `value` over the first element of one stored chunk of a torch_dist folder, in place (the bytes of
    a chunk are a torch.save zip whose tensor data is stored uncompressed). -> (shard file, checkpoint key)."""
    import io

    from moe.dist_checkpoint import read_metadata_safely

    metadata = read_metadata_safely(sub_dir)
    for index, info in sorted(metadata.storage_data.items(), key=lambda item: item[0].fqn):
        path = os.path.join(sub_dir, info.relative_path)
        blob = bytearray(open(path, "rb").read())
        chunk = torch.load(io.BytesIO(bytes(blob[info.offset:info.offset + info.length])), weights_only=True)
        if not chunk.is_floating_point() or chunk.numel() < 16 or float(chunk.reshape(-1)[:4].abs().min()) == 0:
            continue
        raw = chunk.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        at = blob.find(raw, info.offset, info.offset + info.length)
        assert at >= 0, index.fqn
        blob[at:at + chunk.element_size()] = torch.tensor([value], dtype=chunk.dtype).view(torch.uint8).numpy().tobytes()
        with open(path, "wb") as f:
            f.write(blob)
        again = torch.load(io.BytesIO(bytes(blob[info.offset:info.offset + info.length])), weights_only=True)
        assert not torch.isfinite(again.reshape(-1)[0])  # the poison took
        return info.relative_path, index.fqn
    raise AssertionError(f"no chunk to poison in {sub_dir}")


@pytest.mark.slow
def test_a_nan_weight_in_the_newest_checkpoint_falls_back_for_export_and_resume(cli, runs, tmp_path):
    """A step checkpoint whose checksums agree (re-written by whoever wrote the NaN) but which holds a NaN
    weight: export and --resume both say which file and tensor, and take the previous checkpoint."""
    run = tmp_path / "r"
    shutil.copytree(runs["a_only"], run)
    os.remove(run / "checkpoint.pt")
    newest = run / "checkpoints" / "step_000002"
    shard, key = _poison_chunk(str(newest / "model"), float("nan"))
    _rewrite_manifest(str(newest))
    proc = cli.run(["export", "--checkpoint", str(run), "--out", str(tmp_path / "hf")])
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    said = f"step_000002 is corrupt (model/{shard}: {key} holds NaN or infinite values); falling back to step_000001"
    assert said in proc.stdout, proc.stdout
    proc = cli.run(["train", "--config", "configs/tiny_cpu.yaml", *TINY, "rl.steps=3", f"log.out_dir={tmp_path}",
                    "name=r", "--resume"])
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert said in proc.stdout and "resuming from" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.slow
def test_an_infinite_adam_moment_in_the_newest_checkpoint_falls_back(runs, tmp_path):
    """The optimizer state counts too: an inf moment would turn the first resumed update into NaN weights.
    model.init_from=<run folder> (and export) reads the same answer."""
    from megagspo.checkpoint.full_state import load_checkpoint
    from megagspo.checkpoint.state import resolve_checkpoint

    run = tmp_path / "r"
    shutil.copytree(runs["a_only"], run)
    os.remove(run / "checkpoint.pt")
    newest = run / "checkpoints" / "step_000002"
    shard, key = _poison_chunk(str(newest / "optimizer"), float("inf"))
    _rewrite_manifest(str(newest))
    said = []
    assert resolve_checkpoint(str(run), said.append).endswith("step_000001")
    assert f"optimizer/{shard}: {key} holds NaN or infinite values" in said[0], said
    assert load_checkpoint(str(run), said.append)["path"].endswith("step_000001")
    # every checkpoint poisoned: one error naming each, no fall-back left
    _poison_chunk(str(run / "checkpoints" / "step_000001" / "model"), float("-inf"))
    _rewrite_manifest(str(run / "checkpoints" / "step_000001"))
    shutil.rmtree(run / "checkpoints" / "step_000000")
    from megagspo.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="no intact checkpoint under .*holds NaN or infinite values"):
        resolve_checkpoint(str(run), said.append)


@pytest.mark.slow
def test_the_finite_scan_reads_megagspo_chunks_in_place_and_agrees_with_the_loader(runs, tmp_path, monkeypatch):
    """The scan's cost rests on reading each chunk's stored bytes in place (a memory map, no copy): every
    chunk megagspo writes takes that path, and the loader's own reading (torch.load of the chunk) gives the
    same verdict, clean or poisoned."""
    import moe.dist_checkpoint as dist

    step = tmp_path / "step"
    shutil.copytree(os.path.join(runs["a_only"], "checkpoints", "step_000002"), step)
    taken = []
    real = dist._stored_values
    monkeypatch.setattr(dist, "_stored_values", lambda *a: taken.append(real(*a) is not None) or real(*a))
    for sub in ("model", "optimizer"):
        assert dist.first_nonfinite_chunk(str(step / sub)) is None
    assert taken and all(taken), taken
    shard, key = _poison_chunk(str(step / "optimizer"), float("nan"))
    in_place = dist.first_nonfinite_chunk(str(step / "optimizer"))
    monkeypatch.setattr(dist, "_stored_values", lambda *a: None)
    assert in_place == dist.first_nonfinite_chunk(str(step / "optimizer")) == \
        f"{shard}: {key} holds NaN or infinite values"


@pytest.mark.slow
def test_a_metadata_file_claiming_a_huge_tensor_falls_back(runs, tmp_path):
    """model/.metadata rewritten (checksums too) to claim a [10^7, 10^7] tensor: the reader would try a 400 TB
    allocation (a traceback); the checkpoint is corrupt instead and export takes the previous one."""
    import pickle

    from megagspo.checkpoint.full_state import load_checkpoint

    run = tmp_path / "r"
    shutil.copytree(runs["a_only"], run)
    os.remove(run / "checkpoint.pt")
    newest = run / "checkpoints" / "step_000002"
    with open(newest / "model" / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own test file
    key = sorted(metadata.state_dict_metadata)[0]
    metadata.state_dict_metadata[key].size = torch.Size([10**7, 10**7])
    with open(newest / "model" / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    _rewrite_manifest(str(newest))
    said = []
    assert load_checkpoint(str(run), said.append)["path"].endswith("step_000001")
    assert len(said) == 1 and f"{key}' (offsets" in said[0] and "lies outside the tensor's shape" in said[0], said


@pytest.mark.slow
def test_a_non_finite_checkpoint_pt_is_refused_by_export_naming_the_tensor(cli, runs, tmp_path):
    from megagspo.checkpoint.guards import safe_torch_load

    ckpt = safe_torch_load(os.path.join(runs["a_only"], "checkpoint.pt"))
    key = sorted(ckpt["state"])[2]
    ckpt["state"][key].view(-1)[1] = float("inf")
    torch.save(ckpt, tmp_path / "checkpoint.pt")
    proc = cli.run(["export", "--checkpoint", str(tmp_path / "checkpoint.pt"), "--out", str(tmp_path / "hf")])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"{tmp_path / 'checkpoint.pt'}: 1 tensor(s) hold NaN or infinite values ({key})" in proc.stderr, \
        proc.stderr
    assert not (tmp_path / "hf").exists()


def test_a_non_finite_kl_reference_is_refused_naming_the_tensor(tmp_path):
    """reference.safetensors whose record (size, sha256, run id) agrees but which holds a NaN: a resume with a
    KL penalty is refused, naming the file and the tensor, instead of training against NaN log-probs."""
    from megagspo.checkpoint import CheckpointError
    from megagspo.checkpoint.reference import save_reference, verify_reference

    state = {"a.weight": torch.ones(4, 4), "b.weight": torch.ones(3)}
    state["b.weight"][2] = float("nan")
    save_reference(str(tmp_path), state, "run")  # a record that agrees with the file
    with pytest.raises(CheckpointError) as err:
        verify_reference(str(tmp_path), "run")
    assert "reference.safetensors: tensor b.weight holds NaN or infinite values" in str(err.value)
    state["b.weight"][2] = 0.0
    save_reference(str(tmp_path), state, "run")
    assert verify_reference(str(tmp_path), "run").endswith("reference.safetensors")


# ------------------------------------------------ every YAML / JSON file from disk through a bounded reader
def test_a_deeply_nested_yaml_architecture_file_is_a_one_line_error(tmp_path):
    """model.arch_file as YAML: 100,000 levels of nesting crashed PyYAML's loader (RecursionError)."""
    from megagspo.config import ConfigError, load_config

    deep = tmp_path / "arch.yaml"
    deep.write_text(DEEP)
    cfg = load_config(os.path.join(REPO, "configs/tiny_cpu.yaml"), [])
    cfg.model.arch_file = str(deep)
    with pytest.raises(ConfigError) as err:
        cfg.model.architecture(64)
    assert f"{deep}: YAML nested deeper than 256 levels" in str(err.value) and "\n" not in str(err.value)


def test_hf_config_values_and_names_are_cut_in_errors(kit, tmp_path):
    """A 10 MB value or key in config.json, or a 1 MB shard name in the safetensors index, is named cut to
    ~200 characters, never echoed whole; a shard name that leaves the folder is refused."""
    from moe.hf_checkpoint import CheckpointError, SafetensorsSource
    from moe.hf_config import HfConfigError, architecture_from_hf_config

    base = json.loads(open(os.path.join(kit["model"], "config.json")).read())
    for key, value in (("hidden_size", "x" * 10_000_000), ("k" * 10_000_000, 1), ("mlp_only_layers", ["a" * 99] * 10**5)):
        (tmp_path / "config.json").write_text(json.dumps({**base, key: value}))
        with pytest.raises(HfConfigError) as err:
            architecture_from_hf_config(tmp_path)
        assert len(str(err.value)) < 600, len(str(err.value))
    folder = tmp_path / "sharded"
    _sharded(kit, folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    for name in ("b" * 1_000_000, "../model-00001-of-00002.safetensors", "/etc/passwd"):
        bad = dict(index, weight_map={**index["weight_map"], "x.weight": name})
        (folder / "model.safetensors.index.json").write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match="which is not a file name in") as err:
            SafetensorsSource(folder)
        assert len(str(err.value)) < 600


@pytest.mark.slow
def test_export_refuses_a_hostile_generation_config_in_the_source_folder(kit, tmp_path):
    """An HF-initialised run whose tokenizer lives elsewhere: export copies the source folder's
    generation_config.json; a deeply nested one is refused, naming it, never passed on."""
    from safetensors.torch import load_file

    from megagspo.hf_export import export_hf
    from moe.hf_checkpoint import megatron_state_dict_from_hf
    from moe.hf_config import architecture_from_hf_config
    from moe.json_files import JsonFileError

    source = shutil.copytree(kit["model"], tmp_path / "source")
    tokenizer = shutil.copytree(kit["model"], tmp_path / "tokenizer")
    arch = architecture_from_hf_config(source)
    ckpt = {"state": megatron_state_dict_from_hf(load_file(os.path.join(source, "model.safetensors")), arch),
            "arch": dict(arch.__dict__), "tokenizer": str(tokenizer),
            "config": {"model": {"init_from": str(source), "precision": "fp32"}}}
    with open(os.path.join(source, "generation_config.json"), "w") as f:
        f.write(DEEP)
    with pytest.raises(JsonFileError) as err:
        export_hf(ckpt, str(tmp_path / "out"))
    assert f"{source}/generation_config.json: JSON nested deeper than 64 levels" in str(err.value)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------- the dry run and an HF folder's values
@pytest.mark.slow
def test_the_dry_run_says_values_are_checked_at_start_up_and_check_weights_reads_them(cli, kit, tmp_path):
    from safetensors.torch import load_file, save_file

    proc = cli.run(["train", "--dry-run", *_hf_args(kit, kit["model"], tmp_path / "runs")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "NaN / inf weights are refused at start-up" in proc.stdout and "--check-weights" in proc.stdout
    folder = shutil.copytree(kit["model"], tmp_path / "hf")
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    key = sorted(tensors)[5]
    tensors[key].view(-1)[3] = float("nan")
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    proc = cli.run(["train", "--dry-run", "--check-weights", *_hf_args(kit, folder, tmp_path / "runs")])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"{key} holds NaN or infinite values" in proc.stderr, proc.stderr
    proc = cli.run(["train", "--dry-run", "--check-weights", *_hf_args(kit, kit["model"], tmp_path / "runs")])
    assert proc.returncode == 0 and "every value read and finite" in proc.stdout, proc.stderr[-3000:]
    assert not (tmp_path / "runs").exists()
