"""Wire format v1: the events hooks send and the collector accepts.

This module is the single definition of the format. It imports only the standard library so
that the collector can validate against it without importing torch, and so that any other
producer (a shell script, another language) has one readable place to learn the format from.

A batch is ``{"version": 1, "events": [event, ...]}``. Every event carries the same header::

    {"kind": "step", "run": "gpt-small-7", "rank": 0, "host": "node-3",
     "stream": "5f0c...", "seq": 41, "time": 1763771234.5, "fields": {...}}

``stream`` identifies one producer process (a fresh random id each time a ``TrainMonitor``
starts) and ``seq`` counts its events from 0; together they make ingest idempotent, so a
batch that is sent twice (a retry, a spool replay) is stored once. Gaps in ``seq`` are events
the producer dropped, which the collector can count.

JSON has no NaN or infinity, yet a NaN loss is data, not an error. Float fields that may be
non-finite accept the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"``; the body is
strict JSON, so bare ``NaN`` tokens are refused (400). Every other float field must be finite.

Everything is bounded at the door, so that no single accepted event can break a shared view
(``/metrics``, ``runs``, ``status``, ``postmortem``): strings, maps, GPU lists, the nesting and
size of free-form JSON (configs, fingerprints), and ``time`` (seconds since the epoch, up to
2**32).
"""

from __future__ import annotations

import math
import re
import reprlib
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "EVENT_KINDS",
    "HEADER_FIELDS",
    "MAX_EVENTS_PER_BATCH",
    "MAX_INT",
    "MAX_KEY",
    "MAX_MAP",
    "MAX_TIME",
    "PHASES",
    "RUN_ID_PATTERN",
    "SENT_HEADER",
    "VERSION",
    "Event",
    "WireError",
    "decode_float",
    "encode_float",
    "json_safe",
    "json_schema",
    "validate_batch",
    "validate_event",
]

VERSION = 1
MAX_EVENTS_PER_BATCH = 10_000
SENT_HEADER = "X-Trainmon-Sent"
"""HTTP request header: the producer's wall time (seconds since the epoch) when it sent the request.

Optional. The collector estimates each producer's clock offset from it rather than from the events'
own times: a batch replayed from a spool holds events from minutes or days ago, but it is sent now,
so (arrival - sent) stays latency plus skew. A header and not a batch field, so that a collector
older than its producers ignores it instead of refusing the batch.
"""
RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
STREAM_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
PHASES = ("data", "forward", "backward", "comm", "optimizer", "checkpoint", "eval", "other")

_RUN_ID = re.compile(RUN_ID_PATTERN)
_STREAM = re.compile(STREAM_PATTERN)
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


class WireError(ValueError):
    """A batch or event does not follow the wire format; ``path`` names the offending field."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


@dataclass(frozen=True, slots=True)
class Field:
    """One field of an event: its JSON type and whether it is required.

    ``type`` is one of ``int``, ``float``, ``str``, ``bool``, ``float_list``, ``phases`` (an
    object of phase name → seconds), ``float_map`` (name → number), ``gpus`` (a list of per-GPU
    objects, see ``GPU_FIELDS``) and ``json`` (free-form JSON, bounded in depth and size).
    ``nonfinite`` lets a float be NaN/±Infinity (losses and norms, where that is the news).
    """

    type: str
    required: bool = False
    nonfinite: bool = False
    doc: str = ""


def _f(doc: str, **kw: Any) -> Field:
    return Field("float", doc=doc, **kw)


def _i(doc: str, **kw: Any) -> Field:
    return Field("int", doc=doc, **kw)


_FINGERPRINT = Field(
    "json",
    doc="restored or saved state: optimizer step counts and moment norms, scheduler position, "
    "RNG hashes, data position, world size, global batch, config hash",
)

GPU_FIELDS: dict[str, Field] = {
    "index": _i("device index on the node"),
    "uuid": Field("str", doc="NVML UUID"),
    "temperature_c": _f("temperature, degrees Celsius"),
    "utilization_ratio": _f("busy fraction"),
    "mem_used_bytes": _i("memory in use"),
    "mem_total_bytes": _i("memory installed"),
    "power_w": _f("power draw, watts"),
    "sm_clock_hz": _f("SM clock"),
    "throttle_reasons": _i("NVML clock-event reasons bitmask"),
    "ecc_corrected": _i("corrected ECC errors"),
    "ecc_uncorrected": _i("uncorrected ECC errors"),
}

EVENT_KINDS: dict[str, dict[str, Field]] = {
    "run_start": {
        "config": Field("json", doc="the trainer's configuration, as given"),
        "config_hash": Field("str", doc="hash of the configuration, to spot changes on resume"),
        "world_size": _i("number of ranks"),
        "local_rank": _i("rank within the node"),
        "device": Field("str", doc="cpu, cuda:0, ..."),
        "gpu_uuid": Field("str", doc="NVML UUID of the rank's GPU"),
        "framework": Field("str", doc="plain, hf, lightning, reference_trainer"),
        "n_params": _i("model parameter count"),
        "vocab_size": _i("vocabulary size, for the initial-loss check"),
        "pretrained": Field("bool", doc="the model starts from pretrained weights (no ln(vocab) initial loss)"),
        "seq_len": _i("tokens per sequence"),
        "global_batch_tokens": _i("tokens per optimizer step over all ranks"),
        "accum_steps": _i("micro-batches per optimizer step"),
        "planned_steps": _i("optimizer steps the run intends to take"),
        "schedule": Field("json", doc="declared LR schedule, see trainmon.schedules"),
        "schedule_source": Field(
            "str", doc="scheduler: the declared schedule was read off the watched scheduler; user: given to start()"
        ),
        "scheduler": Field(
            "str",
            doc="class of the LR scheduler the hooks watch (CyclicLR, LambdaLR, ...); with no declared schedule, the "
            "LR's shape is then the scheduler's business and only its step count is checked",
        ),
        "loss_floor": _f("lowest reachable loss when known (synthetic data's entropy rate)"),
        "flops_per_token": _f("training FLOPs per token, for MFU"),
        "peak_flops": _f("peak FLOP/s of one device, for MFU"),
        "launch_id": Field(
            "str",
            doc="the job: the same on every rank of one launch and its restarts, different for another job using "
            "the same run name at the same time (trainmon.hooks.launch); without it the collector cannot tell a "
            "concurrent job from a restart",
        ),
        "resumed": Field("bool", doc="true when the run continues from a checkpoint"),
        "resume_path": Field("str", doc="checkpoint the run resumed from"),
        "layout": Field("json", doc="parallel layout {tp, dp, pp}, ranks ordered tp fastest (Megatron-LM's order)"),
        "precursors": Field(
            "json",
            doc="what the instability precursors measure (trainmon.hooks.precursors): {attention: [measured "
            "modules], unrecognised: [attention-like modules not measured], lm_head: true when log Z is measured}",
        ),
    },
    "step": {
        "step": _i("optimizer step index", required=True),
        "loss": _f("training loss of the step", nonfinite=True),
        "grad_norm": _f("total gradient norm before clipping", nonfinite=True),
        "grad_norm_clipped": _f("total gradient norm after clipping", nonfinite=True),
        "clip_coef": _f("factor the gradients were scaled by (1 = not clipped)", nonfinite=True),
        "lr": Field("float_list", doc="learning rate of each param group"),
        "loss_scale": _f("fp16 GradScaler scale", nonfinite=True),
        "skipped": Field("bool", doc="optimizer step skipped (inf/nan grads under GradScaler)"),
        "tokens": _i("tokens processed by this rank in this step"),
        "samples": _i("samples processed by this rank in this step"),
        "micro_batches": _i("forward passes in this step"),
        "scheduler_steps": _i("scheduler.step() calls in this step (1 expected)"),
        "step_time": _f("wall seconds of the step"),
        "phases": Field("phases", doc="seconds per phase: " + ", ".join(PHASES)),
        "mem_allocated_bytes": _i("device memory allocated now"),
        "mem_peak_bytes": _i("peak device memory since the previous step"),
        "batch_fingerprint": Field("str", doc="cheap hash of the batch, for data-replay checks"),
        "layer_grad_norms": Field("float_map", doc="second level: grad norm per parameter name"),
        "update_ratio": _f(
            "second level: ||update|| / ||param|| (the hooks': on sampled steps, over a sample of the parameters, "
            "see trainmon.hooks.precursors)",
            nonfinite=True,
        ),
        "group_update_ratio": Field(
            "float_map",
            doc='second level, sampled steps: per parameter group index ("0", "1", ...), update_ratio over '
            "that group's share of the same sample",
        ),
        "adam_eps_frac": Field(
            "float_map",
            doc="second level, sampled steps: per parameter group index, the fraction of Adam's second-moment "
            "elements (exp_avg_sq, not bias-corrected) below eps**2, after the step's update",
        ),
        "attn_logit_max": Field(
            "float_map",
            doc="second level, sampled steps: per attention module, a bound on the largest attention logit "
            "max|q·k|/√d (largest query row norm x largest key row norm / √d over the heads), see "
            "trainmon.hooks.precursors",
        ),
        "attn_entropy": Field(
            "float_map",
            doc="second level, sampled steps: per attention module, mean entropy in nats of head 0's attention "
            "over the first sequence's first 256 queries (causal where the module is), see trainmon.hooks.precursors",
        ),
        "linear_out_rms": Field(
            "float_map",
            doc="second level, sampled steps: per nn.Linear (QKV and attention output projections, MLP "
            "down-projection of each recognised block), the RMS of its output",
        ),
        "output_logz": _f(
            "second level, sampled steps: mean log-sum-exp of the LM head's logits (z-loss's log Z)", nonfinite=True
        ),
        "output_logit_max": _f("second level, sampled steps: largest |logit| of the LM head", nonfinite=True),
        "weights_checksum": Field(
            "float_list",
            doc="replicated weights the step starts from: [bit-pattern sum bits 0-23, bits 24-47, sum of squares, "
            "parameters left out as sharded], see trainmon.hooks.checksum",
        ),
    },
    "eval": {
        "step": _i("step the evaluation ran after", required=True),
        "loss": _f("evaluation loss", required=True, nonfinite=True),
        "metrics": Field("float_map", doc="other evaluation metrics"),
        "duration": _f("seconds spent evaluating"),
    },
    "checkpoint": {
        "step": _i("step saved", required=True),
        "path": Field("str", doc="where the checkpoint was written"),
        "duration": _f("seconds spent saving"),
        "bytes": _i("size written"),
        "fingerprint": _FINGERPRINT,
    },
    "resume": {
        "step": _i("step restored from the checkpoint", required=True),
        "path": Field("str", doc="checkpoint loaded"),
        "duration": _f("seconds spent loading"),
        "fingerprint": _FINGERPRINT,
        "round_trip_loss": _f("loss of the last logged batch recomputed right after loading", nonfinite=True),
        "logged_loss": _f("the loss logged for that batch before the interruption", nonfinite=True),
    },
    "health": {
        "cpu_percent": _f("process CPU use, percent of one core"),
        "rss_bytes": _i("process resident memory"),
        "host_mem_used_bytes": _i("host memory in use"),
        "host_mem_total_bytes": _i("host memory installed"),
        "rss_samples": Field(
            "float_list",
            doc="process resident memory in bytes, sampled every rss_sample_interval seconds since the "
            "previous health event, oldest first; the last one was taken at this event's time",
        ),
        "rss_sample_interval": _f("seconds between two of the rss_samples"),
        "cgroup_mem_limit_bytes": _i("memory limit of the process's cgroup, when set below the host's memory"),
        "cgroup_mem_used_bytes": _i("memory charged to that cgroup, less inactive file cache (reclaimed first)"),
        "disk_read_bytes": _i("host disk bytes read, cumulative"),
        "disk_write_bytes": _i("host disk bytes written, cumulative"),
        "net_sent_bytes": _i("host network bytes sent, cumulative"),
        "net_recv_bytes": _i("host network bytes received, cumulative"),
        "gpus": Field("gpus", doc="per GPU: " + ", ".join(GPU_FIELDS)),
    },
    "heartbeat": {
        "step": _i("last step the rank finished"),
    },
    "stack": {
        "reason": Field("str", required=True, doc="no_step (no step for a while) or signal (SIGUSR1)"),
        "step": _i("last step the rank finished"),
        "seconds_since_step": _f("seconds since that step ended"),
        "thread": Field("str", doc="name of the training thread"),
        "stack": Field("json", required=True, doc="frames: [{file, line, function, code}], outermost first"),
        "nccl": Field("json", doc="newest NCCL flight-recorder entries, when it is on"),
    },
    "run_end": {
        "status": Field("str", required=True, doc="finished, failed or interrupted"),
        "step": _i("last step"),
        "error": Field("str", doc="exception text when the run failed"),
        "dropped_events": _i("events the producer dropped because its queue was full"),
    },
}

HEADER_FIELDS: dict[str, Field] = {
    "kind": Field("str", required=True, doc="one of " + ", ".join(EVENT_KINDS)),
    "run": Field("str", required=True, doc="run id, " + RUN_ID_PATTERN),
    "rank": Field("int", required=True, doc="global rank of the producer"),
    "host": Field("str", required=True, doc="host name of the producer"),
    "stream": Field("str", required=True, doc="producer id, new each process start"),
    "seq": Field("int", required=True, doc="event number within the stream, from 0"),
    "time": Field("float", required=True, doc="wall time, seconds since the epoch"),
    "fields": Field("fields", required=True, doc="the kind's fields"),
}

_MAX_STR = 4096
MAX_INT = 2**53  # integers every JSON parser reads exactly (doubles), on both sides of the schema
MAX_TIME = 2.0**32  # seconds since the epoch: year 2106; beyond it dates overflow in the views
MAX_KEY = 256  # characters of a name in a float_map or a json object
MAX_MAP = 65_536  # entries of a float_map (per-parameter grad norms of a large model)
_MAX_GPUS = 64
_MAX_DEPTH = 16  # nesting of a json field
_MAX_NODES = 20_000  # values in a json field, all levels


@dataclass(slots=True)
class Event:
    """A validated event, floats decoded (non-finite markers become float NaN/inf).

    Read-only by contract, not by ``frozen``: an event is shared by every reader (the store, the live
    state, each detector, the detection child), so nobody may assign to it. The collector alone stamps
    the events it has just validated (``clock_offset``, and ``run`` for a stream stored apart), before any
    reader sees them; ``tests/test_event_writes.py`` fails on any other write in the package. A frozen
    class's ``__init__`` goes through a setter per field (0.40 us an event; the generated one of this class
    is plain stores, 0.13 us), and both processes of a long import build a million events. Unhashable
    (``__hash__`` is None), as the frozen class with its dict field was in effect."""

    kind: str
    run: str
    rank: int
    host: str
    stream: str
    seq: int
    time: float
    fields: dict[str, Any]
    clock_offset: float | None = field(default=None, compare=False)
    """Seconds that put ``time`` on the collector's clock (``trainmon.clock``): set by the
    collector on events that arrived live, never read from the wire; None on imports."""


def encode_float(x: float) -> float | str:
    """Make a float JSON-safe: non-finite values become the strings the format accepts."""
    if math.isfinite(x):
        return x
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


def json_safe(value: Any) -> Any:
    """Replace non-finite floats by the format's string markers, recursively (strict JSON out)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else encode_float(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def decode_float(value: Any, nonfinite: bool = True) -> float:
    """Read a float field, accepting the non-finite markers only where allowed.

    Raises ``WireError`` with an empty path: the caller knows where the value was.
    """
    if type(value) is float:  # the common case first: ingest validates every field of every event
        x = value
    elif isinstance(value, int) and not isinstance(value, bool):
        x = float(value)
    elif isinstance(value, str) and value in _NONFINITE:
        x = _NONFINITE[value]
    else:
        raise WireError("", f"expected a number, got {_show(value)}")
    if not nonfinite and not math.isfinite(x):
        raise WireError("", f"must be finite, got {value!r}")
    return x


def _name(key: str) -> str:
    """A key as it appears in an error path: quoted when it is not a plain name."""
    return key if key.isidentifier() else repr(key)


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 30, 30


def _show(value: Any) -> str:
    text = _REPR.repr(value)  # bounded in depth: a 1,000-deep value must not exhaust the stack here
    return text if len(text) <= 40 else text[:37] + "..."


def _check_json(value: Any) -> None:
    """Free-form JSON (configs, fingerprints), bounded so one event cannot break storage or a view:
    depth, number of values, string and key lengths, integer range. Iterative: no recursion limit."""
    if not isinstance(value, dict):
        raise WireError("", f"expected an object, got {_show(value)}")
    stack: list[tuple[str, Any, int]] = [("", value, 1)]
    nodes = 0
    while stack:
        path, v, depth = stack.pop()
        nodes += 1
        if nodes > _MAX_NODES:
            raise WireError("", f"more than {_MAX_NODES} values")
        if isinstance(v, dict):
            if depth > _MAX_DEPTH:
                raise WireError(path, f"nested deeper than {_MAX_DEPTH} levels")
            for k, item in v.items():
                if len(k) > MAX_KEY:
                    raise WireError(path, f"a key longer than {MAX_KEY} characters")
                stack.append((f"{path}.{_name(k)}", item, depth + 1))
        elif isinstance(v, list):
            if depth > _MAX_DEPTH:
                raise WireError(path, f"nested deeper than {_MAX_DEPTH} levels")
            stack.extend((f"{path}[{i}]", item, depth + 1) for i, item in enumerate(v))
        elif isinstance(v, str):
            if len(v) > _MAX_STR:
                raise WireError(path, f"longer than {_MAX_STR} characters")
        elif isinstance(v, float):
            if not math.isfinite(v):
                raise WireError(path, f"must be finite, got {v!r}")
        elif isinstance(v, int) and not isinstance(v, bool):
            if abs(v) > 2**63 - 1:
                raise WireError(path, "integer out of the 64-bit range")
        elif v is not None and not isinstance(v, bool):
            raise WireError(path, f"expected a JSON value, got {_show(v)}")


def _check(value: Any, spec: Field) -> Any:
    """Check one value against its field spec; a ``WireError`` carries the path below the field
    (``[3]``, ``.forward``), so the happy path formats no strings."""
    t = spec.type
    if t == "float":
        return decode_float(value, spec.nonfinite)
    if t == "int":
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # JSON Schema's "integer" admits 52.0, and so do we
        if isinstance(value, bool) or not isinstance(value, int):
            raise WireError("", f"expected an integer, got {_show(value)}")
        if not 0 <= value <= MAX_INT:
            raise WireError("", f"must be between 0 and 2**53, got {value}")
        return value
    if t == "str":
        if not isinstance(value, str):
            raise WireError("", f"expected a string, got {_show(value)}")
        if len(value) > _MAX_STR:
            raise WireError("", f"longer than {_MAX_STR} characters")
        return value
    if t == "bool":
        if not isinstance(value, bool):
            raise WireError("", f"expected true or false, got {_show(value)}")
        return value
    if t == "fields":  # checked field by field by validate_event
        if not isinstance(value, dict):
            raise WireError("", f"expected an object, got {_show(value)}")
        return value
    if t == "json":
        _check_json(value)
        return value
    if t == "float_map":
        if not isinstance(value, dict):
            raise WireError("", f"expected an object of numbers, got {_show(value)}")
        if len(value) > MAX_MAP:
            raise WireError("", f"more than {MAX_MAP} entries")
        for k, v in value.items():
            if len(k) > MAX_KEY:
                raise WireError("", f"a key longer than {MAX_KEY} characters")
            if type(v) is not float:
                try:
                    decode_float(v)
                except WireError as exc:
                    raise WireError(f".{_name(k)}", exc.problem) from None
        return value  # as sent: stored as JSON, where the non-finite markers must stay strings
    if t == "float_list":
        if not isinstance(value, list):
            raise WireError("", f"expected a list of numbers, got {_show(value)}")
        for v in value:
            if type(v) is not float:
                break
        else:
            return value  # all floats: any float is allowed here (non-finite included)
        out = []
        for i, v in enumerate(value):
            try:
                out.append(decode_float(v))
            except WireError as exc:
                raise WireError(f"[{i}]", exc.problem) from None
        return out
    if t == "phases":
        if not isinstance(value, dict):
            raise WireError("", f"expected an object of phase seconds, got {_show(value)}")
        phases = {}
        for name, secs in value.items():
            if name not in _PHASE_SET:
                raise WireError(f".{name}", f"unknown phase, expected one of {PHASES}")
            if type(secs) is float and secs - secs == 0.0:  # finite: inf - inf and nan - nan are nan
                phases[name] = secs
                continue
            try:
                phases[name] = decode_float(secs, nonfinite=False)
            except WireError as exc:
                raise WireError(f".{name}", exc.problem) from None
        return phases
    if t == "gpus":
        if not isinstance(value, list):
            raise WireError("", f"expected a list of GPU objects, got {_show(value)}")
        if len(value) > _MAX_GPUS:
            raise WireError("", f"more than {_MAX_GPUS} GPUs")
        gpus = []
        for i, gpu in enumerate(value):
            if not isinstance(gpu, dict):
                raise WireError(f"[{i}]", f"expected an object, got {_show(gpu)}")
            checked = {}
            for k, v in gpu.items():
                gpu_spec = GPU_FIELDS.get(k)
                if gpu_spec is None:
                    raise WireError(f"[{i}].{_name(k)}", f"unknown GPU field, expected one of {list(GPU_FIELDS)}")
                if v is None:
                    continue
                try:
                    checked[k] = _check(v, gpu_spec)
                except WireError as exc:
                    raise WireError(f"[{i}].{k}{exc.path}", exc.problem) from None
            gpus.append(checked)
        return gpus
    raise AssertionError(f"unknown field type {t}")


_PHASE_SET = frozenset(PHASES)
_REQUIRED = {kind: tuple(k for k, spec in specs.items() if spec.required) for kind, specs in EVENT_KINDS.items()}


def validate_event(raw: Any, path: str = "event") -> Event:
    """Check one event against the format and return it decoded."""
    if not isinstance(raw, dict):
        raise WireError(path, f"expected an object, got {_show(raw)}")
    for key in raw:
        if key not in HEADER_FIELDS:
            raise WireError(f"{path}.{_name(key)}", "unknown field")
    header = {}
    for key, header_spec in HEADER_FIELDS.items():
        if key not in raw:
            raise WireError(f"{path}.{key}", "missing required field")
        try:
            header[key] = _check(raw[key], header_spec)
        except WireError as exc:
            raise WireError(f"{path}.{key}{exc.path}", exc.problem) from None
    if not 0.0 <= header["time"] <= MAX_TIME:
        raise WireError(f"{path}.time", f"must be seconds since the epoch, between 0 and 2**32, got {header['time']}")
    kind = header["kind"]
    if kind not in EVENT_KINDS:
        raise WireError(f"{path}.kind", f"unknown kind {kind!r}, expected one of {list(EVENT_KINDS)}")
    if not _RUN_ID.match(header["run"]):
        raise WireError(f"{path}.run", f"invalid run id {_show(header['run'])}, must match {RUN_ID_PATTERN}")
    if not _STREAM.match(header["stream"]):
        raise WireError(f"{path}.stream", f"invalid stream id, must match {STREAM_PATTERN}")
    specs = EVENT_KINDS[kind]
    fields = {}
    for key, value in header["fields"].items():
        spec = specs.get(key)
        if spec is None:
            raise WireError(f"{path}.fields.{_name(key)}", f"unknown field for kind {kind!r}")
        if type(value) is float and spec.type == "float" and (spec.nonfinite or value - value == 0.0):
            fields[key] = value  # the common case, without a call: most fields of a step are floats
            continue
        if value is None and not spec.required:
            continue
        try:
            fields[key] = _check(value, spec)
        except WireError as exc:
            raise WireError(f"{path}.fields.{key}{exc.path}", exc.problem) from None
    for key in _REQUIRED[kind]:
        if key not in fields:
            raise WireError(f"{path}.fields.{key}", f"missing required field for kind {kind!r}")
    header["fields"] = fields
    return Event(**header)


def parse_sent(value: bytes | str | None) -> float | None:
    """The :data:`SENT_HEADER` value as seconds since the epoch; None when absent or not a plausible time
    (the header is advisory: a bad one falls back to the events' times, it never refuses a batch)."""
    if value is None:
        return None
    try:
        sent = float(value)
    except ValueError:
        return None
    return sent if 0.0 < sent <= MAX_TIME else None  # NaN fails the comparison


def validate_batch(raw: Any) -> list[Event]:
    """Check a decoded JSON batch; raise ``WireError`` naming the first bad field.

    A batch is accepted or rejected whole, so a rejected batch never leaves a partial write.
    """
    if not isinstance(raw, dict):
        raise WireError("batch", f"expected an object with 'version' and 'events', got {_show(raw)}")
    for key in raw:
        if key not in ("version", "events"):
            raise WireError(_name(key), "unknown field")
    if "version" not in raw:
        raise WireError("version", "missing required field")
    version = raw["version"]
    if version != VERSION or isinstance(version, bool):
        raise WireError("version", f"unsupported version {_show(version)}, this collector speaks {VERSION}")
    events = raw.get("events")
    if not isinstance(events, list):
        raise WireError("events", f"expected a list of events, got {_show(events)}")
    if len(events) > MAX_EVENTS_PER_BATCH:
        raise WireError("events", f"{len(events)} events, at most {MAX_EVENTS_PER_BATCH} per batch")
    return [validate_event(e, f"events[{i}]") for i, e in enumerate(events)]


_JSON_TYPES: dict[str, dict[str, Any]] = {
    "int": {"type": "integer", "minimum": 0, "maximum": MAX_INT},
    "str": {"type": "string", "maxLength": _MAX_STR},
    "bool": {"type": "boolean"},
    "fields": {"type": "object"},
    "json": {"type": "object", "description": f"at most {_MAX_DEPTH} levels deep and {_MAX_NODES} values"},
}
_NUMBER: dict[str, Any] = {"type": "number"}
_NUMBER_OR_MARKER: dict[str, Any] = {"anyOf": [{"type": "number"}, {"enum": list(_NONFINITE)}]}


def _field_schema(spec: Field) -> dict[str, Any]:
    schema: dict[str, Any]
    if spec.type == "float":
        schema = dict(_NUMBER_OR_MARKER if spec.nonfinite else _NUMBER)
    elif spec.type == "float_list":
        schema = {"type": "array", "items": _NUMBER_OR_MARKER}
    elif spec.type == "float_map":
        schema = {
            "type": "object",
            "additionalProperties": _NUMBER_OR_MARKER,
            "propertyNames": {"maxLength": MAX_KEY},
            "maxProperties": MAX_MAP,
        }
    elif spec.type == "gpus":
        schema = {
            "type": "array",
            "maxItems": _MAX_GPUS,
            "items": {
                "type": "object",
                "properties": {k: _field_schema(g) for k, g in GPU_FIELDS.items()},
                "additionalProperties": False,
            },
        }
    elif spec.type == "phases":
        schema = {
            "type": "object",
            "properties": {p: _NUMBER for p in PHASES},
            "additionalProperties": False,
        }
    else:
        schema = dict(_JSON_TYPES[spec.type])
    if spec.doc:
        schema["description"] = spec.doc
    return schema


def json_schema() -> dict[str, Any]:
    """The batch format as JSON Schema, for the collector's OpenAPI description."""
    variants = []
    for kind, specs in EVENT_KINDS.items():
        header = {k: _field_schema(s) for k, s in HEADER_FIELDS.items()}
        header["kind"] = {"const": kind}
        header["run"] = {"type": "string", "pattern": RUN_ID_PATTERN}
        header["stream"] = {"type": "string", "pattern": STREAM_PATTERN}
        header["time"] = {**_NUMBER, "minimum": 0, "maximum": MAX_TIME, "description": HEADER_FIELDS["time"].doc}
        header["fields"] = {
            "type": "object",
            "properties": {k: _field_schema(s) for k, s in specs.items()},
            "required": [k for k, s in specs.items() if s.required],
            "additionalProperties": False,
        }
        variants.append(
            {
                "title": f"{kind} event",
                "type": "object",
                "properties": header,
                "required": list(HEADER_FIELDS),
                "additionalProperties": False,
            }
        )
    return {
        "title": "trainmon event batch",
        "type": "object",
        "properties": {
            "version": {"const": VERSION},
            "events": {"type": "array", "items": {"oneOf": variants}, "maxItems": MAX_EVENTS_PER_BATCH},
        },
        "required": ["version", "events"],
        "additionalProperties": False,
    }
