"""Format detection by structure, wherever the lines are; terminal output decoded as a terminal showed it.

A text log is recognised by its lines, not by its first 64 KiB: a SLURM job's shell trace and
argument dump, or megabytes of ``uv`` progress bars and escape codes, come before the first step
line. A file is binary only on binary evidence (NUL bytes, non-UTF-8 density once escapes are gone).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from trainmon.monitor.importers import ImportFormatError, detect_format, read_events, terminal
from trainmon.monitor.importers.terminal import binary_evidence, clean_line, text_chunks
from trainmon.monitor.importers.textlog import sniff_textlog


def _meg_line(it: int, loss: float) -> str:
    return (
        f" iteration {it:8d}/{100:8d} | consumed samples: {it * 8:12d} | elapsed time per iteration (ms): 1000.0 |"
        f" learning rate: 1.000E-04 | global batch size:     8 | lm loss: {loss:.6E} | loss scale: 65536.0 |"
        " grad norm: 1.000 | number of skipped iterations:   0 | number of nan iterations:   0 |\n"
    )


def _shell_trace(n_bytes: int) -> str:
    """A SLURM job's ``bash -x`` trace: nothing in it names a trainer."""
    lines = []
    size = k = 0
    while size < n_bytes:
        lines.append(f"+ export MODULEPATH=/gpfslocalsup/pub/module-rh/modulefiles:/opt/modules/{k}\n")
        lines.append(f"++ /usr/bin/modulecmd bash load cuda/11.2 nccl/2.8.3 gcc/8.3.1 # {k}\n")
        size += len(lines[-1]) + len(lines[-2])
        k += 1
    return "".join(lines)


def test_megatron_lines_after_a_long_preamble_are_recognised(tmp_path: Path) -> None:
    """96/99: the first iteration line at byte 122,353 / 918,733, with no Megatron word before it."""
    path = tmp_path / "slurm-1999618.out"
    path.write_text(_shell_trace(300_000) + "".join(_meg_line(k, 10.0 - k / 10) for k in range(1, 6)))
    assert "iteration" not in path.read_text()[: 64 * 1024]
    assert detect_format(path) == "textlog"
    steps = [e.fields for e in read_events(path) if e.kind == "step"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    assert steps[0]["loss"] == pytest.approx(9.9)


def _progress_bars(n_bytes: int) -> str:
    """What ``uv`` prints to a terminal: colours, cursor moves, erase-line, CR redraws, an OSC hyperlink."""
    out: list[str] = []
    k = 0
    while k * 300 < n_bytes:
        out.append(
            f"\x1b[2mtorch   \x1b[0m \x1b[32m{'-' * (k % 30)}\x1b[2m\x1b[0m {k}.0 MiB/847.96 MiB      "
            "\x1b[1A\r\x1b[2K\x1b[1B\r\x1b[2K\x1b[1A\x1b[37m\u280b\x1b[0m"
            " \x1b[2mPreparing packages...\x1b[0m (85/86)\r\n"
        )
        out.append("\x1b]8;;https://docs.astral.sh/uv\x1b\\uv docs\x1b]8;;\x1b\\\r\n")
        k += 1
    return "".join(out)


def test_escape_codes_and_progress_bars_are_text_not_binary(tmp_path: Path) -> None:
    """101/103: a log opening with a megabyte of progress bars was rejected 'as binary'."""
    path = tmp_path / "speedrun.log"
    steps = "".join(f"step {k} | loss {3.0 - k / 10:.4f} | lr 1.0e-04 | norm 0.5 | dt 500.00ms\r\n" for k in range(5))
    path.write_bytes((_progress_bars(200_000) + steps).encode())
    assert not binary_evidence(path.read_bytes()[:4096])
    assert detect_format(path) == "textlog"
    got = [e.fields for e in read_events(path) if e.kind == "step"]
    assert [s["step"] for s in got] == [0, 1, 2, 3, 4] and got[1]["loss"] == pytest.approx(2.9)


def test_keystrokes_and_redraws_do_not_hide_a_step_line(tmp_path: Path) -> None:
    """Arrow keys typed into the terminal (ESC [ B) land before a step line; a trainer redrawing its
    line with \\r shows each step in turn: every state is read."""
    path = tmp_path / "typed.log"
    path.write_text(
        "\x1b[B\x1b[Bstep 1 | loss 2.5 | lr 1e-4\n"
        "\rstep 2 | loss 2.4 | lr 1e-4\rstep 3 | loss 2.3 | lr 1e-4\n"
        "step 4 | loss 9.9\b\b\b2.2 | lr 1e-4\n"
    )
    got = [(e.fields["step"], e.fields["loss"]) for e in read_events(path) if e.kind == "step"]
    assert got == [(1, 2.5), (2, 2.4), (3, 2.3), (4, 2.2)]


def test_clean_line() -> None:
    assert clean_line("\x1b[32m\x1b[1mINFO\x1b[0m - ready\r\n") == ["INFO - ready"]
    assert clean_line("\x1b]8;;https://x.org\x1b\\link\x1b]8;;\x07 text\n") == ["link text"]
    assert clean_line(" 10%|#   \r 50%|#####  \r\n") == ["10%|#", "50%|#####"]
    assert clean_line("abc\b\bd\n") == ["ad"]
    assert clean_line("\x1bOBstep 1\x1b[38;5;178m!\x1b\n") == ["step 1!"]
    assert clean_line("\x1b[2K\r\n") == []


def test_binary_only_on_binary_evidence(tmp_path: Path) -> None:
    assert binary_evidence(b"step 1 loss 2.0\x00\x00\x01")
    assert binary_evidence(bytes(range(128, 256)) * 8)  # not UTF-8 at all
    assert not binary_evidence(b"\x1b[2K\x1b[1A\r" * 500 + b"ok\n")  # escapes are text
    assert not binary_evidence("Epoch 1: r\xe9sum\xe9 of the run, loss 2.0\n".encode("latin-1") * 50)  # a few odd bytes
    # The error says what the file is: escapes removed from the line it quotes, "binary" only for binary.
    path = tmp_path / "notes.log"
    path.write_text("\x1b[1m\x1b[32mHello\x1b[0m from a colourful tool\n" * 20)
    with pytest.raises(ImportFormatError, match=r"unrecognised log format .*the line 'Hello from a colourful tool'"):
        detect_format(path)
    blob = tmp_path / "weights.bin"
    blob.write_bytes(b"\x00\x01\x02\x03" * 100_000)
    with pytest.raises(ImportFormatError, match="starts with binary data"):
        detect_format(blob)


def test_a_hole_of_nuls_is_a_gap_in_the_text_not_binary(tmp_path: Path) -> None:
    """A node that crashed while its log grew leaves a block of NULs where the file was extended;
    the job requeued appends after it. Scattered NULs (a real binary file) stay binary."""
    path = tmp_path / "requeued.out"
    before = _shell_trace(2000).encode() + _meg_line(1, 9.0).encode() + _meg_line(2, 8.5).encode()
    path.write_bytes(b"\0" * 8192 + before + b"\0" * 70_000 + _meg_line(3, 8.0).encode() + _meg_line(4, 7.5).encode())
    assert not binary_evidence(path.read_bytes()[: 64 * 1024])
    assert detect_format(path) == "textlog"
    assert [e.fields["loss"] for e in read_events(path) if e.kind == "step"] == [9.0, 8.5, 8.0, 7.5]
    assert binary_evidence(b"step 1 | loss 2.0\n" * 100 + bytes([0, 7, 0, 0, 3, 0]) * 50)


def test_lines_past_the_contiguous_scan_are_found_by_probes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the contiguous scan, pieces spread over the file (its last piece included) still find the
    training lines, and what is read stays bounded whatever the file's size."""
    monkeypatch.setattr(terminal, "SCAN_CONTIGUOUS", 256 * 1024)
    monkeypatch.setattr(terminal, "CHUNK", 64 * 1024)
    path = tmp_path / "huge.out"
    path.write_text(_shell_trace(3_000_000) + "".join(_meg_line(k, 9.0) for k in range(1, 4)))
    assert sniff_textlog(path) == "megatron"
    read = sum(len(piece) for piece in text_chunks(path))
    assert read <= 256 * 1024 + terminal.SCAN_PROBES * 64 * 1024 + 64 * 1024
    noise = tmp_path / "noise.txt"
    noise.write_text(_shell_trace(3_000_000))
    with pytest.raises(ImportFormatError, match="unrecognised log format"):
        detect_format(noise)


def test_the_scan_of_an_unrecognised_big_file_is_bounded(tmp_path: Path) -> None:
    path = tmp_path / "big.txt"
    path.write_text(_shell_trace(terminal.SCAN_CONTIGUOUS + 4 * terminal.CHUNK))
    with pytest.raises(ImportFormatError, match="unrecognised log format"):
        detect_format(path)
    read = sum(len(piece) for piece in text_chunks(path))
    assert read <= terminal.SCAN_CONTIGUOUS + (terminal.SCAN_PROBES + 1) * terminal.CHUNK
