"""The reference trainer: exact resume, learning to the entropy floor, CLI and config errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.trainer_helpers import TINY, attempts, losses, of_kind, read_events, run_trainer, trainer_cli
from trainmon.fingerprint import compare_fingerprints
from trainmon.reference_trainer.config import ConfigError, TrainConfig, build_parser, config_from_args, load_toml
from trainmon.reference_trainer.data import Loader, MarkovSource, TokenFileSource
from trainmon.wire import validate_event


@pytest.mark.slow
def test_exact_resume_reproduces_uninterrupted_losses(tmp_path):
    """Crash after step 12 (checkpoints at 4 and 9), resume: every loss equals the straight run's."""
    args = [*TINY, "--checkpoint-every", "5", "--eval-every", "5"]
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    run_trainer(straight, *args, steps=20)
    run_trainer(broken, *args, "--stop-at", "12", steps=20)
    run_trainer(broken, *args, "--resume", str(broken), steps=20)

    want = losses(read_events(straight / "events.jsonl"))
    events = read_events(broken / "events.jsonl")
    first, second = attempts(events)
    assert of_kind(first, "run_end")[-1]["status"] == "interrupted"
    assert max(f["step"] for f in of_kind(first, "step")) == 12
    # the second attempt re-does steps 10..12 from the step-9 checkpoint, then finishes
    resume = of_kind(second, "resume")[0]
    assert resume["step"] == 9
    assert sorted(losses(second)) == list(range(10, 20))
    for attempt in (first, second):
        for step, loss in losses(attempt).items():
            assert loss == want[step], f"step {step}: {loss} != {want[step]}"  # exact, not approximate
    # eval losses match too (eval draws no random numbers)
    evals = {f["step"]: f["loss"] for f in of_kind(read_events(straight / "events.jsonl"), "eval")}
    assert {f["step"]: f["loss"] for f in of_kind(second, "eval")} == {s: evals[s] for s in (14, 19)}
    # the restored state's fingerprint equals the one saved with the checkpoint
    saved = next(f for f in of_kind(first, "checkpoint") if f["step"] == 9)
    assert compare_fingerprints(saved["fingerprint"], resume["fingerprint"]) == {}
    assert saved["fingerprint"]["optimizer"]["adam_step_max"] == 10
    assert of_kind(second, "run_start")[0]["resumed"] is True
    # every event is valid wire format
    for e in events:
        validate_event(e)


@pytest.mark.slow
def test_clean_default_run_learns_from_ln_v_to_entropy_floor(tmp_path):
    """The default config starts near ln(V) and ends near the Markov chain's entropy floor."""
    run_trainer(tmp_path, "--eval-every", "100", steps=200)
    events = read_events(tmp_path / "events.jsonl")
    cfg = TrainConfig()
    floor = MarkovSource(cfg.vocab_size, cfg.seed, cfg.markov_branching).entropy_floor
    ln_v = math.log(cfg.vocab_size)
    assert 0.5 < floor < ln_v - 2
    start = of_kind(events, "run_start")[0]
    assert start["vocab_size"] == cfg.vocab_size
    assert start["loss_floor"] == pytest.approx(floor)
    loss = losses(events)
    assert abs(loss[0] - ln_v) < 0.15
    tail = [loss[s] for s in range(180, 200)]
    assert floor - 0.1 < sum(tail) / len(tail) < floor + 0.2
    final_eval = of_kind(events, "eval")[-1]
    assert final_eval["step"] == 199
    assert floor - 0.05 < final_eval["loss"] < floor + 0.15
    assert all(not f.get("skipped") for f in of_kind(events, "step"))
    assert of_kind(events, "run_end")[-1]["status"] == "finished"
    assert not (tmp_path / "labels.json").exists()


def test_help_documents_every_option():
    proc = trainer_cli("--help")
    assert proc.returncode == 0
    text = proc.stdout
    for action in build_parser()._actions:
        for flag in action.option_strings:
            assert flag in text
        if action.dest != "help":
            assert action.help and len(action.help) > 10, action.dest
    for field in TrainConfig.__dataclass_fields__:
        assert "--" + field.replace("_", "-") in text
    for kind in ("loss_spike", "resume_no_optimizer", "hang", "bad_init"):
        assert kind in text  # the fault catalog is in the epilog


def test_toml_config_and_precedence(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('run = "from-toml"\nsteps = 7\nout = "x"\nn-layer = 3\nlr = 1\ninject = ["nan@3"]\n')
    cfg = config_from_args(["--config", str(path), "--steps", "9"])
    assert (cfg.run, cfg.steps, cfg.n_layer, cfg.lr, cfg.inject) == ("from-toml", 9, 3, 1.0, ["nan@3"])


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("n_layers = 2", "n_layers: unknown field"),
        ("n_layers = 2", "did you mean 'n_layer'"),
        ('lr = "fast"', "lr: expected float"),
        ("steps = 1.5", "steps: expected int"),
        ("n_head = 3\nrun='r'\nsteps=1\nout='o'", "n_head: must divide n_embd=64"),
        ("run = 'r'\nsteps = 1\nout = 'o'\nschedule = 'step'", "schedule: unknown schedule 'step'"),
    ],
)
def test_toml_bad_field_is_named(tmp_path, text, needle):
    path = tmp_path / "bad.toml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError, match=needle):
        config_from_args(["--config", str(path)])


def test_bad_config_file_cli_error_names_field(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("warmup = 5\n")
    proc = trainer_cli("--config", str(path))
    assert proc.returncode == 2
    assert "warmup: unknown field" in proc.stderr


def test_load_toml_accepts_every_field(tmp_path):
    cfg = TrainConfig(run="r", steps=3, out="o")
    path = tmp_path / "all.toml"
    lines = []
    for key, value in cfg.to_dict().items():
        if value is not None:
            lines.append(f"{key} = {json.dumps(value)}")
    path.write_text("\n".join(lines) + "\n")
    assert TrainConfig(**load_toml(path)) == cfg


def test_config_hash_ignores_io_fields():
    a = TrainConfig(run="a", steps=5, out="x")
    assert a.config_hash() == TrainConfig(run="b", steps=5, out="y", checkpoint_every=2).config_hash()
    assert a.config_hash() != TrainConfig(run="a", steps=5, out="x", batch_size=16).config_hash()


def test_token_file_source_and_rank_split(tmp_path):
    """nanoGPT-style uint16 files: deterministic windows, shifted targets, distinct per rank."""
    import numpy as np

    tokens = (np.arange(5000) * 7 % 50).astype(np.uint16)
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    src = TokenFileSource(path, vocab_size=50, seed=3)
    a, b = Loader(src, 4, 16, rank=0, world_size=2), Loader(src, 4, 16, rank=1, world_size=2)
    x0, y0 = a.next()
    x1, _ = b.next()
    assert x0.shape == (4, 16) and x0.dtype == torch.long
    assert torch.equal(x0[:, 1:], y0[:, :-1])  # targets are the next tokens
    assert not torch.equal(x0, x1)
    assert a.state_dict()["position"] == 1
    again = Loader(src, 4, 16, rank=0, world_size=2)
    assert torch.equal(again.next()[0], x0)  # a pure function of the position
    val_x, _ = a.val_batch(0)
    assert int(val_x.min()) >= 0 and val_x.shape == (4, 16)


def test_trains_on_a_token_file(tmp_path):
    import numpy as np

    src = MarkovSource(64, 5, 4)
    seq = torch.cat([torch.cat([x[:, :1], y], 1) for x, y in (src.batch(i, 0, 16, 63) for i in range(20))])
    path = tmp_path / "data.bin"
    seq.numpy().astype(np.uint16).tofile(path)
    run_trainer(tmp_path / "out", *TINY, "--data", str(path), "--eval-every", "5", steps=10)
    events = read_events(tmp_path / "out" / "events.jsonl")
    loss = losses(events)
    assert loss[9] < loss[0]
    assert "loss_floor" not in of_kind(events, "run_start")[0]  # unknown for real data
