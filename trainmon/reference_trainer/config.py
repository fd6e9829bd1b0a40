"""The trainer's configuration: one typed dataclass, a TOML file, and command-line overrides.

Precedence is defaults < ``--config FILE.toml`` < command-line options. Every field is an
option (``n_layer`` → ``--n-layer``) and every option's help text is the field's ``help``
metadata, so ``--help`` documents everything there is. A TOML key that is not a field, or a
value of the wrong type, is named in the error (with a suggestion for likely typos).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import hashlib
import json
import re
import tomllib
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from trainmon.schedules import SCHEDULE_NAMES
from trainmon.wire import RUN_ID_PATTERN

__all__ = ["ConfigError", "TrainConfig", "build_parser", "config_from_args", "load_toml", "parse_layout"]

PRECISIONS = ("auto", "fp32", "bf16", "fp16")


class ConfigError(ValueError):
    """A configuration problem; the message starts with the offending field's name."""


def _opt(default: Any, help: str, group: str) -> Any:
    """A scalar field with its ``--help`` text and option group."""
    return field(default=default, metadata={"help": help, "group": group})


@dataclass
class TrainConfig:
    """Everything a run depends on. Fields marked I/O do not change the maths of training."""

    # -- run and I/O ------------------------------------------------------------------------
    run: str = _opt(
        "",
        "run id shared by all ranks (letters, digits, '.', '_', '-'); required. Under torchrun write "
        "--run-id NAME (torchrun takes --run for its own --run-path)",
        "run",
    )
    steps: int = _opt(0, "optimizer steps to train (also the LR schedule's length); required", "run")
    out: str = _opt("", "output folder: checkpoints/, events.jsonl, labels.json; required", "run")
    collector: str | None = _opt(
        None,
        "where events go: http://HOST:PORT of a trainmon collector or file://PATH for JSONL "
        "(default file://OUT/events.jsonl; ranks > 0 of a multi-rank run write "
        "events.rankN.jsonl next to it)",
        "run",
    )
    resume: str | None = _opt(None, "resume from the latest complete checkpoint under this folder", "run")
    inject: list[str] = field(
        default_factory=list,
        metadata={
            "help": "inject a fault, KIND@STEP[:key=value,...]; repeatable; see the fault catalog below",
            "group": "run",
            "metavar": "KIND@STEP[:PARAMS]",
        },
    )
    checkpoint_every: int = _opt(0, "save a checkpoint every K steps (0: only at the last step)", "run")
    keep_checkpoints: int = _opt(3, "complete checkpoints to keep (older ones are deleted)", "run")
    eval_every: int = _opt(0, "evaluate on the held-out split every K steps and at the end (0: never)", "run")
    eval_batches: int = _opt(4, "batches per rank in each evaluation", "run")
    stop_at: int | None = _opt(
        None,
        "simulate a crash: stop after this step without the final checkpoint (run_end status 'interrupted')",
        "run",
    )
    stop_on: str | None = _opt(
        None,
        "stop at the next step boundary when the collector reports a finding of this run at or above "
        "this severity (critical or warning): save a checkpoint (single process), end the run as failed "
        "and exit 3 with the finding; needs --collector http://...",
        "run",
    )
    detail_every: int = _opt(
        100,
        "send the second-level signals (per-layer grad norms, update ratio, instability precursors) every K steps "
        "(0: never on a schedule)",
        "run",
    )
    heartbeat_interval: float = _opt(5.0, "seconds between heartbeat events (0: none)", "run")
    health_interval: float = _opt(10.0, "seconds between node-health samples (0: none)", "run")
    checksum_every: int = _opt(
        10, "checksum the weights every K steps, for the replica/shard check across ranks (0: never)", "run"
    )
    # -- model -------------------------------------------------------------------------------
    n_layer: int = _opt(2, "transformer blocks", "model")
    n_head: int = _opt(2, "attention heads (must divide n_embd)", "model")
    n_embd: int = _opt(64, "model width", "model")
    vocab_size: int = _opt(64, "vocabulary size (token files: must exceed the largest token id)", "model")
    seq_len: int = _opt(64, "tokens per sequence (context length)", "model")
    dropout: float = _opt(0.1, "dropout probability; > 0 makes RNG restore matter on resume", "model")
    init_std: float = _opt(0.02, "standard deviation of the normal weight init", "model")
    # -- data --------------------------------------------------------------------------------
    data: str = _opt(
        "markov",
        "'markov' for the synthetic Markov-chain source (known entropy floor), or a path to a "
        "nanoGPT-style uint16 token file",
        "data",
    )
    val_data: str | None = _opt(None, "uint16 token file for evaluation (default: the last 10% of --data)", "data")
    markov_branching: int = _opt(4, "successors per token in the Markov chain (sets the entropy floor)", "data")
    batch_size: int = _opt(8, "sequences per micro-batch per rank", "data")
    accum: int = _opt(1, "gradient-accumulation micro-batches per optimizer step", "data")
    # -- optimisation ----------------------------------------------------------------------
    lr: float = _opt(3e-3, "peak learning rate", "optim")
    schedule: str = _opt("cosine", "LR schedule: " + ", ".join(SCHEDULE_NAMES), "optim")
    warmup_steps: int = _opt(10, "linear warmup steps (capped at --steps)", "optim")
    min_lr_ratio: float = _opt(0.1, "final LR as a fraction of the peak (cosine, wsd, linear)", "optim")
    decay_fraction: float = _opt(0.2, "share of the steps spent decaying (wsd)", "optim")
    weight_decay: float = _opt(0.1, "AdamW decoupled weight decay (matrices only)", "optim")
    beta1: float = _opt(0.9, "AdamW beta1", "optim")
    beta2: float = _opt(0.95, "AdamW beta2", "optim")
    grad_clip: float = _opt(1.0, "clip the global grad norm to this (0: no clipping)", "optim")
    precision: str = _opt(
        "auto",
        "auto (bf16 autocast on GPU, fp32 on CPU), fp32, bf16, or fp16 (GradScaler; on CPU an "
        "emulated dynamic loss scale with fp16 overflow)",
        "optim",
    )
    init_scale: float = _opt(65536.0, "initial fp16 loss scale", "optim")
    # -- system ------------------------------------------------------------------------------
    seed: int = _opt(1337, "seed (model init, data chain; each rank derives its own runtime seed)", "system")
    device: str = _opt("auto", "auto, cpu, cuda or cuda:N", "system")
    threads: int = _opt(0, "torch CPU threads (0: leave torch's default)", "system")
    dist_timeout: float = _opt(300.0, "seconds a collective may wait before the process group fails", "system")
    layout: str = _opt(
        "",
        "simulated parallel layout, tp=N: ranks in groups of N consecutive ranks act as the shards of one "
        "tensor-parallel group (each initialised from seed + its tp rank, DDP only across groups); the monitor "
        "checks that shards differ and replicas agree. Cannot --resume (one copy of the weights is saved)",
        "system",
    )
    peak_flops: float = _opt(
        0.0, "peak FLOP/s of one device, for MFU (0: looked up for known GPUs, else not reported)", "system"
    )

    # Fields that do not change what is trained (left out of config_hash).
    IO_FIELDS = (
        "run",
        "out",
        "collector",
        "resume",
        "inject",
        "checkpoint_every",
        "keep_checkpoints",
        "eval_every",
        "eval_batches",
        "stop_at",
        "stop_on",
        "device",
        "threads",
        "dist_timeout",
        "heartbeat_interval",
        "health_interval",
        "detail_every",
        "checksum_every",
    )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def config_hash(self) -> str:
        """Hash of the fields that change the maths, to spot a different config on resume."""
        maths = {k: v for k, v in self.to_dict().items() if k not in self.IO_FIELDS}
        return hashlib.blake2b(json.dumps(maths, sort_keys=True).encode(), digest_size=8).hexdigest()

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first field with a bad value."""

        def bad(name: str, problem: str) -> None:
            raise ConfigError(f"{name}: {problem}")

        if not self.run:
            bad("run", "required (--run NAME)")
        if not re.match(RUN_ID_PATTERN, self.run):
            bad("run", f"invalid run id {self.run!r}, must match {RUN_ID_PATTERN}")
        if self.steps < 1:
            bad("steps", f"required and must be at least 1 (--steps N), got {self.steps}")
        if not self.out:
            bad("out", "required (--out DIR)")
        for name in ("n_layer", "n_head", "n_embd", "seq_len", "batch_size", "accum", "eval_batches"):
            if getattr(self, name) < 1:
                bad(name, f"must be at least 1, got {getattr(self, name)}")
        if self.vocab_size < 2:
            bad("vocab_size", f"must be at least 2, got {self.vocab_size}")
        if self.n_embd % self.n_head:
            bad("n_head", f"must divide n_embd={self.n_embd}, got {self.n_head}")
        if not 0 <= self.dropout < 1:
            bad("dropout", f"must be within [0, 1), got {self.dropout}")
        if not 1 <= self.markov_branching <= self.vocab_size:
            bad("markov_branching", f"must be within [1, vocab_size], got {self.markov_branching}")
        if self.schedule not in SCHEDULE_NAMES:
            bad("schedule", f"unknown schedule {self.schedule!r}, expected one of {SCHEDULE_NAMES}")
        if self.precision not in PRECISIONS:
            bad("precision", f"unknown precision {self.precision!r}, expected one of {PRECISIONS}")
        if not self.lr > 0:
            bad("lr", f"must be positive, got {self.lr}")
        for name in ("checkpoint_every", "eval_every", "warmup_steps", "detail_every"):
            if getattr(self, name) < 0:
                bad(name, f"must be 0 or more, got {getattr(self, name)}")
        if self.keep_checkpoints < 1:
            bad("keep_checkpoints", f"must be at least 1, got {self.keep_checkpoints}")
        if self.grad_clip < 0:
            bad("grad_clip", f"must be 0 (off) or positive, got {self.grad_clip}")
        if self.stop_at is not None and not 0 <= self.stop_at < self.steps:
            bad("stop_at", f"must be within [0, steps), got {self.stop_at}")
        if self.stop_on is not None and self.stop_on not in ("critical", "warning"):
            bad("stop_on", f"critical or warning, got {self.stop_on!r}")
        if self.stop_on is not None and not (self.collector or "").startswith(("http://", "https://")):
            bad("stop_on", "needs a collector to report findings: --collector http://HOST:PORT")
        if self.checksum_every < 0:
            bad("checksum_every", f"must be 0 or more, got {self.checksum_every}")
        try:
            tp = parse_layout(self.layout).get("tp", 1)
        except ValueError as exc:
            bad("layout", str(exc))
        if tp > 1 and self.resume is not None:
            bad("layout", "a tensor-parallel layout cannot --resume: checkpoints hold one copy of the weights")
        if self.data != "markov" and not Path(self.data).is_file():
            bad("data", f"'markov' or an existing token file, got {self.data!r}")


def parse_layout(text: str) -> dict[str, int]:
    """``--layout`` as a TrainMonitor layout: ``""`` (every rank a data-parallel replica) or ``tp=N``."""
    if not text:
        return {}
    key, eq, value = text.partition("=")
    if key.strip() != "tp" or not eq or not value.strip().isdigit() or int(value) < 1:
        raise ValueError(f"expected tp=N with N >= 1, got {text!r}")
    return {"tp": int(value)}


_HINTS = get_type_hints(TrainConfig)
_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def _base_type(name: str) -> type:
    """The scalar type of a field (``int`` for ``int | None``, ``str`` for ``list[str]``)."""
    hint = _HINTS[name]
    if get_origin(hint) in (Union, types.UnionType):
        hint = next(a for a in get_args(hint) if a is not type(None))
    if get_origin(hint) is list:
        hint = get_args(hint)[0]
    return hint


def _coerce(name: str, value: Any, where: str) -> Any:
    """Check a TOML value against the field's type; ints are accepted where floats are."""
    hint = _HINTS[name]
    optional = get_origin(hint) in (Union, types.UnionType)
    base = _base_type(name)
    if get_origin(hint) is list or hint == list[str]:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{name}: expected a list of strings in {where}, got {value!r}")
        return value
    if optional and value is None:
        return None
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, base) or (base is int and isinstance(value, bool)):
        raise ConfigError(f"{name}: expected {base.__name__} in {where}, got {type(value).__name__} {value!r}")
    return value


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML config (flat keys; ``-`` or ``_`` both accepted), naming any unknown key."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"config: cannot read {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config: {path} is not valid TOML: {exc}") from exc
    out = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in _FIELDS:
            close = difflib.get_close_matches(name, list(_FIELDS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{key}: unknown field in {path}{hint}")
        out[name] = _coerce(name, value, str(path))
    return out


def build_parser() -> argparse.ArgumentParser:
    """The CLI: one option per field, grouped, each documented, plus ``--config``."""
    from trainmon.reference_trainer.faults import catalog_help  # late: faults imports this module

    parser = argparse.ArgumentParser(
        prog="python -m trainmon.reference_trainer",
        description="Reference GPT trainer for trainmon: small GPT on synthetic or token-file data, "
        "AdamW, LR schedules, grad accumulation, clipping, full-state checkpoint/resume, DDP via "
        "torchrun, and deterministic fault injection with ground-truth labels.",
        epilog=catalog_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,  # only options actually given override the config file
    )
    parser.add_argument("--config", metavar="FILE.toml", help="TOML file with any of the options below (flat keys)")
    groups = {
        "run": parser.add_argument_group("run, checkpoints and events"),
        "model": parser.add_argument_group("model"),
        "data": parser.add_argument_group("data"),
        "optim": parser.add_argument_group("optimisation"),
        "system": parser.add_argument_group("system"),
    }
    for f in dataclasses.fields(TrainConfig):
        meta = f.metadata
        flag = "--" + f.name.replace("_", "-")
        base = _base_type(f.name)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        help_text = meta["help"] + (f" (default: {default})" if default not in (None, "", 0, []) else "")
        kwargs: dict[str, Any] = {"help": help_text.replace("%", "%%"), "dest": f.name}
        if f.name == "inject":
            kwargs["action"] = "append"
        else:
            kwargs["type"] = base
        kwargs["metavar"] = meta.get("metavar", f.name.upper())
        flags = [flag]
        if f.name == "run":  # torchrun rejects "--run" as an abbreviation of its "--run-path"
            flags.append("--run-id")
        groups[meta["group"]].add_argument(*flags, **kwargs)
    return parser


def config_from_args(argv: list[str] | None = None) -> TrainConfig:
    """Parse the command line (and ``--config``) into a validated ``TrainConfig``."""
    args = vars(build_parser().parse_args(argv))
    values: dict[str, Any] = {}
    config_path = args.pop("config", None)
    if config_path is not None:
        values.update(load_toml(config_path))
    values.update(args)
    cfg = TrainConfig(**values)
    cfg.validate()
    return cfg
