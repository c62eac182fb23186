"""The hostile-input battery (issue "Checkpoints that never lose a run" §4; table in docs/robustness.md).

Each input gets a clear error (exit code 2 and a message naming the key / file / reason) or a counted,
documented exclusion, and none of them touches an existing run's checkpoint: every case runs against a run
folder that holds an intact checkpoint, whose files' sha256 are compared before and after.
"""

import io
import json
import math
import os
import pickle
import subprocess
import sys
import time

import pytest

from megagspo.checkpoint import REQUIRED, verify, write_checkpoint
from megagspo.checkpoint.store import sha256_file
from helpers import REPO, CliRuns
from multiprocess import cpu_pinned_env

TINY = ["sft.steps=1", "sft.batch_size=4", "rl.steps=1", "rl.batch.prompts_per_step=2", "rl.batch.group_size=2",
        "rl.batch.mini_batches=1", "data.train_size=50", "data.eval_size=5", "log.progress=false", "threads=1",
        "log.plots=false", "log.tensorboard=false"]


def _snapshot(root):
    """sha256 of every file under root, except the owner lock file (who holds the folder, not run data)."""
    from megagspo.checkpoint.run_lock import LOCK_FILE

    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name == LOCK_FILE:
                continue
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, root)] = sha256_file(path)
    return out


def _fake_state(**arch_changes):
    """A trainer_state.json for this recipe's model (TINY), optionally for another model."""
    from megagspo.checkpoint.state import arch_dict
    from megagspo.config import load_config
    from megagspo.data.tokenizer import BuiltinTokenizer

    cfg = load_config(os.path.join(REPO, "configs/tiny_cpu.yaml"), TINY)
    arch = arch_dict(cfg.model.architecture(BuiltinTokenizer().vocab_size))
    arch.update(arch_changes)
    return {"step": 2, "phase": "rl", "world": 1, "arch": arch, "tokenizer": "builtin", "dataset_size": 50,
            "config": cfg.to_dict(), "metrics": {"count": 1, "rows": [{"phase": "rl", "step": 0.0}]}}


def _put(data):
    return lambda p: open(p, "wb").write(data)


def _fake_files(payload) -> dict:
    """Writers for every file a checkpoint requires: payload(name) bytes, but JSON where the JSON files are
    read (a checkpoint is intact only when they pass the bounded JSON reader)."""
    writers = {name: _put(payload(name)) for name in REQUIRED}
    writers["model/metadata.json"] = _put(json.dumps({"sharded_backend": "torch_dist"}).encode())
    return writers


@pytest.fixture
def run(tmp_path):
    """A run folder `tmp/r` with an intact (small, synthetic) checkpoint and a metrics.jsonl."""
    run_dir = tmp_path / "r"
    (run_dir).mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"phase": "rl", "step": 0.0}) + "\n")
    writers = _fake_files(lambda name: b"payload " + name.encode())
    writers["trainer_state.json"] = _put(json.dumps(_fake_state()).encode())
    write_checkpoint(str(run_dir / "checkpoints"), 2, writers)
    before = _snapshot(run_dir)
    yield tmp_path, run_dir
    assert _snapshot(run_dir) == before, "a hostile input changed the existing run folder"
    assert verify(str(run_dir / "checkpoints" / "step_000002"), REQUIRED) is None


def _cli_inprocess(capsys, *args):
    """`megagspo train` in this process: for inputs rejected before any process group exists."""
    from megagspo.cli import main

    rc = main(["train", *args])
    return rc, capsys.readouterr().err


def _env():
    return cpu_pinned_env(OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _cli_subprocess(*args):
    """`megagspo train` in a process of its own (a run that fails mid-way)."""
    proc = subprocess.run([sys.executable, "-m", "megagspo.cli", "train", *args], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=180)
    return proc.returncode, proc.stderr


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """One process, not this one, for the module's refused `megagspo train` commands that get as far as a process
    group: a command costs its work, not a fresh start-up."""
    runs = CliRuns(_env(), str(tmp_path_factory.mktemp("cli") / "stderr.log"))
    yield runs
    runs.close()


def _cli_served(cli, *args):
    """`megagspo train` made by `cli`."""
    proc = cli.run(["train", *args], timeout=180)
    return proc.returncode, proc.stderr


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rows(n=60, prompt="12+34=", answer="46"):
    return [{"prompt": prompt, "answer": answer} for _ in range(n)]


# (id, builder(tmp_path) -> extra CLI args, expected message fragment)
CONFIG_AND_DATA_CASES = [
    ("malformed_yaml", lambda t: ["--config", str(_write(t / "bad.yaml", b"rl: {steps: [1, 2\n"))],
     "is not valid YAML"),
    ("non_utf8_yaml", lambda t: ["--config", str(_write(t / "bad.yaml", b"name: \xff\xfe\n"))], "not UTF-8"),
    ("unknown_key", lambda t: ["rl.stepz=3"], "unknown config key 'rl.stepz'"),
    ("unknown_section", lambda t: ["trainer.steps=3"], "unknown config key 'trainer'"),
    ("malformed_override", lambda t: ["rl.steps=[1"], "not valid YAML"),
    ("negative_clip", lambda t: ["rl.loss.clip_low=-0.2"], "rl.loss.clip_low must be a finite number"),
    ("nan_lr", lambda t: ["rl.optim.lr=.nan"], "rl.optim.lr must be a finite number"),
    ("zero_group_size", lambda t: ["rl.batch.group_size=0"], "rl.batch.group_size must be a positive integer"),
    ("group_size_one", lambda t: ["rl.batch.group_size=1", "rl.batch.mini_batches=1"], "rl.batch.group_size must be >= 2"),
    ("negative_timeout", lambda t: ["reward.timeout_s=-1"], "reward.timeout_s must be"),
    ("keep_zero_checkpoints", lambda t: ["checkpoint.keep_last=0"], "checkpoint.keep_last must be a positive"),
    ("resume_from_nowhere", lambda t: [f"checkpoint.resume={t}/nope"], "checkpoint.resume"),
    ("non_utf8_data", lambda t: _data(t, NON_UTF8), "is not UTF-8 text"),
    ("not_json_data", lambda t: _data(t, b"{prompt: 1+2}\n"), "d.jsonl:1: not valid JSON"),
    ("empty_data_file", lambda t: _data(t, b""), "holds no rows"),
    ("huge_prompt", lambda t: _data(t, _rows() + _rows(1, "1" * 200_000)),
     "prompts are longer than data.max_prompt_tokens = 8 (as the model sees them"),
    ("unencodable_prompt", lambda t: _data(t, _rows() + _rows(1, "h\u00e9llo")),
     "built-in tokenizer cannot encode character"),
    ("prompt_not_a_string", lambda t: _data(t, [{"prompt": 7, "answer": "2"}] * 60),
     "must be a string or a chat message list"),
    ("prompt_list_not_messages", lambda t: _data(t, [{"prompt": [1], "answer": "2"}] * 60),
     "message 0 must be an object with string 'role' and 'content'"),
    ("chat_prompt_builtin_tokenizer", lambda t: _data(t, [{"prompt": [{"role": "user", "content": "1+1="}],
                                                           "answer": "2"}] * 60),
     "the built-in tokenizer takes string prompts"),
    ("answer_not_a_string", lambda t: _data(t, [{"prompt": "1+1=", "answer": [2]}] * 60),
     "'answer' a string or number"),
    ("duplicate_section", lambda t: _recipe(t, "rl:\n  lr: 5.0e-5\n  steps: 3\nseed: 1\nrl:\n  steps: 4\n"),
     "duplicate key 'rl' at line 5 (first at line 1)"),
    ("duplicate_key_in_section", lambda t: _recipe(t, "rl:\n  lr: 5.0e-5\n  lr: 1.0e-3\n"),
     "duplicate key 'lr' at line 3 (first at line 2)"),
    ("huge_recipe", lambda t: _recipe(t, "# " + "x" * (1 << 20) + "\nseed: 1\n"), "a recipe is at most 1048576 bytes"),
    ("alias_bomb", lambda t: _recipe(t, ALIAS_BOMB), "rl.optim.lr must be a finite number"),
    ("deep_flow_yaml", lambda t: _recipe(t, "seed: " + "[" * 100_000 + "\n"), "more than 256 deep"),
    ("deep_block_yaml", lambda t: _recipe(t, "seed:\n  " + "- " * 50_000 + "x\n"), "more than 256 deep"),
    ("tabs_and_garbage_yaml", lambda t: _recipe(t, "rl:\n\t- lr: [1\n"), "is not valid YAML"),
    ("deep_json_row", lambda t: _data(t, b'{"prompt": ' + b"[" * 200_000 + b"]" * 200_000 + b', "answer": "2"}\n'),
     "JSON nested deeper than 64 levels"),
    ("json_row_with_nul", lambda t: _data(t, b'{"prompt": "1+1=\x00", "answer": "2"}\n' * 60),
     "not valid JSON"),
    ("empty_tokenizer_folder", lambda t: [f"data.tokenizer={_mkdir(t / 'tok_empty')}"], "holds no tokenizer"),
    ("tokenizer_without_vocabulary", lambda t: [f"data.tokenizer={_tokenizer_config_only(t)}"],
     "could not be loaded (ValueError"),
    ("tokenizer_with_an_empty_vocabulary", lambda t: [f"data.tokenizer={_tokenizer_only_unk(t)}"],
     "has no vocabulary besides its 1 special token(s)"),
    ("overrides_on_both_sides_of_resume", lambda t: ["rl.steps=3", "--resume", "rl.loss.clip_low=-1"],
     "rl.loss.clip_low must be a finite number"),

]


# Nine levels of nine-fold aliases: a few hundred bytes that are 9^9 strings when written out in full.
ALIAS_BOMB = "rl:\n  optim:\n    lr: [" + ", ".join(
    [f"&a0 [{', '.join(['lol'] * 9)}]"] + [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]) + "]\n"


def _recipe(t, text: str) -> list:
    """CLI args using a recipe file holding `text` (which replaces configs/tiny_cpu.yaml)."""
    path = t / "recipe.yaml"
    path.write_text(text)
    return ["--config", str(path)]


def _mkdir(path):
    path.mkdir(exist_ok=True)
    return path


def _tokenizer_config_only(t):
    """A tokenizer folder whose tokenizer_config.json names a class but whose vocabulary files are missing."""
    folder = _mkdir(t / "tok_no_vocab")
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder


def _tokenizer_only_unk(t):
    """A loadable tokenizer whose vocabulary is just <unk> (its vocab file emptied): size 1."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    folder = _mkdir(t / "tok_unk_only")
    backend = Tokenizer(models.WordLevel(vocab={"<unk>": 0}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<unk>").save_pretrained(folder)
    return folder


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


NON_UTF8 = b'{"prompt": "1+\xff", "answer": "2"}\n' * 60


def _data(t, content):
    """CLI args for data.task=file with a JSONL file holding `content` (bytes, or rows to serialise)."""
    path = t / "d.jsonl"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        _jsonl(path, content)
    return ["data.task=file", "data.eval_size=5", f"data.train_path={path}"]


@pytest.mark.parametrize("case, build, needle", CONFIG_AND_DATA_CASES, ids=[c[0] for c in CONFIG_AND_DATA_CASES])
def test_bad_config_and_data_get_a_clear_error(run, capsys, case, build, needle):
    tmp, _ = run
    extra = build(tmp)
    base = ["--config", os.path.join(REPO, "configs/tiny_cpu.yaml")]
    if "--config" in extra:
        base, extra = extra[:2], extra[2:]
    rc, err = _cli_inprocess(capsys, *base, *TINY, *extra, f"log.out_dir={tmp}", "name=r")  # extra last: it wins
    assert rc == 2, err
    assert err.startswith("megagspo train: error:") and needle in err, err
    assert "Traceback" not in err
    assert len(err) < 2500, f"an error message of {len(err)} characters"  # values printed are cut short


def test_huge_and_empty_prompts_counted_exclusion_or_accepted(tmp_path):
    from megagspo.config import load_config
    from megagspo.data import build_datasets

    path = _jsonl(tmp_path / "d.jsonl", _rows() + _rows(3, "9" * 1_000_000) + _rows(2, ""))
    cfg = load_config(os.path.join(REPO, "configs/tiny_cpu.yaml"),
                      ["data.task=file", f"data.train_path={path}", "data.eval_size=5", "data.drop_long_prompts=true"])
    tok, train, held_out, stats = build_datasets(cfg.data)
    assert stats["dropped_long_prompts"] == 3            # huge: dropped and counted (summary.json "data")
    assert len(train) + len(held_out) == 62              # empty prompts kept: the model sees just <bos>
    assert any(ex.prompt == "" and ex.prompt_ids == (tok.bos_id,) for ex in train + held_out)


def test_nan_inf_raising_and_out_of_range_rewards_are_counted():
    from megagspo.rewards import RewardStats, score_batch

    values = iter([float("nan"), float("inf"), -float("inf"), 2.5, -1.0, 0.5, "x"])

    def verifier(response, answer):
        v = next(values)
        if v == "x":
            raise RuntimeError("verifier bug")
        return v

    stats = RewardStats()
    scores = score_batch(verifier, ["r"] * 7, ["a"] * 7, stats)
    assert scores == [0.0, 0.0, 0.0, 1.0, 0.0, 0.5, 0.0]
    assert stats.errors == 4 and stats.clamped == 2 and all(math.isfinite(s) for s in scores)
    assert "non-finite reward" in stats.first_error


def test_hanging_verifier_is_cut_off_and_counted():
    from megagspo.checkpoint import VerifierTimeout, with_time_limit
    from megagspo.rewards import RewardStats, score_batch

    def hangs(response, answer):
        if response == "hang":
            while True:
                time.sleep(0.01)
        return 1.0

    stats = RewardStats()
    t0 = time.perf_counter()
    scores = score_batch(with_time_limit(hangs, 0.2), ["hang", "ok", "hang"], ["a"] * 3, stats)
    assert time.perf_counter() - t0 < 3.0
    assert scores == [0.0, 1.0, 0.0] and stats.errors == 2
    assert stats.first_error.startswith(VerifierTimeout.__name__) and "reward.timeout_s = 0.2" in stats.first_error


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # would create the marker file when unpickled


@pytest.mark.parametrize("kind", ["truncated_safetensors", "garbage_safetensors", "truncated_pt", "pickle_with_code"])
def test_unsafe_or_damaged_weight_files_get_a_clear_error(tmp_path, kind):
    import torch
    from safetensors.torch import save_file

    from megagspo.checkpoint import CheckpointError
    from megagspo.checkpoint.full_state import load_checkpoint

    marker = tmp_path / "pwned"
    if kind.endswith("safetensors"):
        path = tmp_path / "w.safetensors"
        save_file({"w": torch.zeros(1000)}, str(path))
        if kind == "truncated_safetensors":
            os.truncate(path, os.path.getsize(path) // 2)
        else:
            path.write_bytes(b"\x00" * 64)
        needle = "not a readable safetensors file"
    elif kind == "truncated_pt":
        path = tmp_path / "c.pt"
        torch.save({"state": {"w": torch.zeros(1000)}}, str(path))
        os.truncate(path, os.path.getsize(path) // 2)
        needle = "cannot be read as a weights-only torch file"
    else:
        path = tmp_path / "c.pt"
        buf = io.BytesIO()
        torch.save({"state": {}, "x": _Evil(str(marker))}, buf, pickle_protocol=2)
        path.write_bytes(buf.getvalue())
        needle = "cannot be read as a weights-only torch file"
    with pytest.raises(CheckpointError, match=needle):
        load_checkpoint(str(path))
    assert not marker.exists()


def test_sharded_checkpoint_whose_metadata_carries_code_is_refused(tmp_path):
    """A crafted step folder with a self-consistent manifest: torch.distributed.checkpoint would unpickle its
    `.metadata` with plain pickle; megagspo reads it with an allow-list first, so the code never runs."""
    import torch

    from megagspo.checkpoint import CheckpointError
    from megagspo.checkpoint.full_state import load_checkpoint

    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    pickle.dump({"x": _Evil(str(marker))}, buf)
    state = _fake_state()
    state.update(config={}, model_index={"w": {"key": "w", "offset": []}})

    def common(p):
        torch.save({}, p)

    writers = {"model/.metadata": _put(buf.getvalue()),
               "model/metadata.json": _put(json.dumps({"sharded_backend": "torch_dist"}).encode()),
               "model/common.pt": common, "rng.safetensors": _put(b"x"),
               "trainer_state.json": _put(json.dumps(state).encode())}
    path = write_checkpoint(str(tmp_path / "checkpoints"), 3, writers)
    assert verify(path, REQUIRED) is None  # the manifest is consistent: only the content is hostile
    with pytest.raises(CheckpointError, match="refusing to unpickle io.open"):
        load_checkpoint(path)
    assert not marker.exists()


def test_every_torch_load_in_the_package_is_weights_only():
    import re

    offenders = []
    for dirpath, _, files in [w for top in ("megagspo", "moe") for w in os.walk(os.path.join(REPO, top))]:
        for name in files:
            if name.endswith(".py"):
                text = open(os.path.join(dirpath, name)).read()
                for m in re.finditer(r"torch\.load\(([^)]*)\)", text):
                    if "weights_only=True" not in m.group(1):
                        offenders.append(f"{name}: {m.group(0)}")
    assert not offenders, offenders


@pytest.mark.slow
@pytest.mark.parametrize("case", ["other_model", "all_corrupt"])
def test_bad_checkpoints_on_resume_fail_cleanly_and_are_left_alone(cli, run, case):
    tmp, run_dir = run
    target = tmp / "other"
    if case == "other_model":
        writers = _fake_files(lambda name: b"x")
        writers["trainer_state.json"] = _put(json.dumps(_fake_state(hidden_size=64, num_experts=8)).encode())
        write_checkpoint(str(target / "checkpoints"), 4, writers)
        needle = "was written for a different model (hidden_size: 64 in the checkpoint, 128 now"
    else:
        writers = {name: _put(b"x") for name in REQUIRED}
        path = write_checkpoint(str(target / "checkpoints"), 4, writers)
        os.truncate(os.path.join(path, "model", ".metadata"), 0)
        needle = "no intact checkpoint"
    other_before = _snapshot(target)
    # resume another folder's checkpoint, with the intact run `r` as the output folder: neither may change
    rc, err = _cli_served(cli, "--config", "configs/tiny_cpu.yaml", *TINY, f"log.out_dir={tmp}", "name=r",
                          f"checkpoint.resume={target}")
    assert rc == 2 and needle in err, err[-3000:]
    assert "Traceback" not in err
    assert _snapshot(target) == other_before


# ---------------------------------------------------------------------------------- the run folder's owner
def test_resume_with_nothing_to_resume_is_refused(tmp_path, capsys):
    rc, err = _cli_inprocess(capsys, "--config", os.path.join(REPO, "configs/tiny_cpu.yaml"), *TINY, "--resume",
                             f"log.out_dir={tmp_path}", "name=never_ran")
    assert rc == 2 and "--resume: no checkpoint under" in err and "checkpoint.resume=auto" in err, err
    assert not os.path.exists(tmp_path / "never_ran" / "metrics.jsonl")


@pytest.mark.slow
def test_resume_refuses_changed_settings_naming_each(cli, run):
    tmp, _ = run
    rc, err = _cli_served(cli, "--config", "configs/tiny_cpu.yaml", *TINY, f"log.out_dir={tmp}", "name=r",
                          "--resume", "rl.loss.name=grpo", "seed=3", "rl.optim.lr=0.0002")  # lr: not run-defining
    assert rc == 2, err[-3000:]
    assert "rl.loss.name: 'gspo' in the checkpoint, 'grpo' now" in err and "seed: 0 in the checkpoint, 3 now" in err
    assert "rl.optim.lr" not in err and "checkpoint.allow_config_change=true" in err and "Traceback" not in err


@pytest.mark.slow
def test_a_second_owner_is_refused_and_the_folder_is_left_alone(cli, run):
    """While another process owns the run folder, neither a fresh run nor a resume touches it."""
    from megagspo.checkpoint.run_lock import RunFolderLock

    tmp, run_dir = run
    with RunFolderLock(str(run_dir), "the first trainer"):
        for extra in ([], ["--resume"]):
            rc, err = _cli_served(cli, "--config", "configs/tiny_cpu.yaml", *TINY, f"log.out_dir={tmp}", "name=r",
                                  *extra)
            assert rc == 2 and f"is in use by the first trainer (pid {os.getpid()} on" in err, err[-3000:]
            assert "Traceback" not in err
    # the fixture checks that every file of the run is byte-identical


@pytest.mark.slow
def test_a_trainer_owns_its_run_folder_until_it_ends(cli, tmp_path):
    from megagspo.config import load_config
    from megagspo.trainer.trainer import Trainer

    cfg = load_config(os.path.join(REPO, "configs/tiny_cpu.yaml"),
                      [*TINY, "sft.steps=0", "rl.steps=0", f"log.out_dir={tmp_path}", "name=owned"])
    trainer = Trainer(cfg, quiet=True)
    rc, err = _cli_served(cli, "--config", "configs/tiny_cpu.yaml", *TINY, f"log.out_dir={tmp_path}", "name=owned")
    assert rc == 2 and f"is in use by megagspo sft (pid {os.getpid()} on" in err, err[-3000:]
    trainer.train(rl=False)  # ends the run: the folder is free again
    with open(tmp_path / "owned" / ".megagspo.lock") as f:
        assert json.load(f)["pid"] == os.getpid()
    from megagspo.checkpoint.run_lock import RunFolderLock

    RunFolderLock(str(tmp_path / "owned"), "next").acquire().release()


def test_a_fresh_start_that_fails_its_checks_leaves_the_run_resumable(run, capsys, monkeypatch):
    """A fresh run over earlier checkpoints (--overwrite: without it the start is refused) that fails after
    choosing its resume point (here: building the model) has not moved them aside, nor written anything:
    --resume still finds them."""
    from megagspo.config import ConfigError
    from megagspo.policy import megatron_policy as policy

    def fail(*args, **kwargs):
        raise ConfigError("injected: the model cannot be built")

    monkeypatch.setattr(policy.MegatronPolicy, "__init__", fail)
    tmp, run_dir = run
    rc, err = _cli_inprocess(capsys, "--config", os.path.join(REPO, "configs/tiny_cpu.yaml"), *TINY,
                             f"log.out_dir={tmp}", "name=r", "--overwrite")
    assert rc == 2 and "injected: the model cannot be built" in err, err
    assert os.path.isdir(run_dir / "checkpoints" / "step_000002")  # not moved aside
    assert not [p for p in os.listdir(tmp) if "replaced" in p] and not (run_dir / "config.yaml").exists()
    from megagspo.checkpoint.run_lock import RunFolderLock

    RunFolderLock(str(run_dir), "next").acquire().release()  # the failed start let go of the folder


@pytest.mark.slow
def test_an_output_folder_that_is_a_file_is_one_clear_line(cli, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    rc, err = _cli_served(cli, "--config", "configs/tiny_cpu.yaml", *TINY, f"log.out_dir={tmp_path / 'file'}")
    assert rc == 2 and err.strip().splitlines()[-1].startswith("megagspo train: error:"), err[-3000:]
    assert "not a directory" in err and str(tmp_path / "file") in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------- a full disk
def test_write_failures_are_named_by_their_cause(tmp_path, monkeypatch):
    import errno
    import shutil

    from megagspo.errors import os_error_message, write_failure_message

    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "metrics.jsonl"))
    assert os_error_message(full) == f"{tmp_path / 'metrics.jsonl'}: disk full (no space left on device)"
    assert os_error_message(OSError(errno.EROFS, "x", "/r")) == "/r: read-only filesystem"
    assert os_error_message(OSError(errno.ENOTDIR, "x", "/a/b")) == "/a/b: a path component is not a directory"
    try:  # an OSError behind a library's own exception is found
        try:
            raise full
        except OSError as inner:
            raise RuntimeError("Worker failure") from inner
    except RuntimeError as wrapped:
        assert "disk full" in write_failure_message(wrapped, str(tmp_path))
    # Megatron's writer: "unexpected pos" with no errno; the free space left tells a full disk apart
    opaque = RuntimeError("Worker failure: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598\n"
                          "Traceback (most recent call last): ...")
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=4096))
    message = write_failure_message(opaque, str(tmp_path))
    assert message.startswith(f"{tmp_path}: disk full (4096 bytes left") and "\n" not in message
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=1 << 40))
    assert write_failure_message(opaque, str(tmp_path)).startswith("RuntimeError: Worker failure")


def _mount_tmpfs(path, mib: int) -> bool:
    path.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(path)], capture_output=True)
    return proc.returncode == 0


@pytest.mark.slow
def test_a_full_disk_during_a_checkpoint_says_so_and_keeps_the_previous(tmp_path):
    """On a real 11 MiB filesystem: cold_start.pt (~2 MB) and step_000000 (~2 MB, no optimizer yet) fit,
    step_000001 (~8 MB with the optimizer's masters and moments) does not."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, 11):
        pytest.skip("mounting a tmpfs needs privileges this host does not give; test_write_failures_are_named_by_"
                    "their_cause covers the message")
    try:
        rc, err = _cli_subprocess("--config", "configs/tiny_cpu.yaml", *TINY, "rl.steps=3",
                                  "checkpoint.every_steps=1", f"log.out_dir={disk}", "name=full")
        assert rc == 1, err[-3000:]
        last = err.strip().splitlines()[-1]
        assert last.startswith("megagspo train: error: writing checkpoint step_000001") and "disk full" in last, last
        assert "the earlier checkpoints are intact" in last
        assert verify(str(disk / "full" / "checkpoints" / "step_000000"), REQUIRED) is None
        assert not [p for p in os.listdir(disk / "full" / "checkpoints") if ".tmp" in p]  # partial files removed
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_yaml_merge_keys_are_still_a_recipe_feature(tmp_path):
    """The duplicate-key check leaves YAML's merge key alone: merged keys may be overridden."""
    from megagspo.config import load_config

    path = tmp_path / "merge.yaml"
    path.write_text("sft: &schedule\n  lr: 0.002\n  warmup_steps: 5\nrl:\n  <<: *schedule\n  lr: 0.0002\n")
    cfg = load_config(str(path))
    assert (cfg.sft.optim.lr, cfg.rl.optim.warmup_steps, cfg.rl.optim.lr) == (0.002, 5, 0.0002)
