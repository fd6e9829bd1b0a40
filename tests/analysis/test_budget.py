"""``trainmon.monitor.core.budget`` and ``trainmon budget``: every worked number of the seeds, reproduced.

Seeds: 001 the theory notebook, 002 "Infra math for LLM training", 003 "Planning LLM
training" (GPT-2 XL), 004 "How to train an LLM" (the 8B Megatron example).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from trainmon.flops import peak_flops_for, training_flops_per_token
from trainmon.monitor.cli import main
from trainmon.monitor.core import budget as b

ROOT = Path(__file__).resolve().parents[2]
GPT2_XL = {"layers": 48, "d_model": 1600, "vocab": 50257, "heads": 25, "seq": 1024}


# -- seed 003: GPT-2 XL --------------------------------------------------------------------------


def test_gpt2_xl_params_and_16p() -> None:
    p = b.param_count(48, 1600, 50257)
    assert p == 1_555_126_400
    assert b.model_state_bytes(p, "fp32") / 1e9 == pytest.approx(24.88, abs=0.005)
    # GPT-2 proper also learns 1024 x 1600 position embeddings; the seed leaves them out.
    assert b.param_count(48, 1600, 50257, 1024, learned_positions=True) == p + 1024 * 1600


def test_gpt2_xl_max_batch_3_on_80gb_fp32() -> None:
    states = b.model_state_bytes(b.param_count(48, 1600, 50257), "fp32")
    act = b.activation_bytes_per_sequence(48, 1024, 1600, 25, 50257, value_bytes=4)
    assert b.max_micro_batch(80e9, states, act) == 3
    # The seed's own count: "4A ~ 14.3 x B GB" (that is GiB), "24.88 + 14.3B <= 80 -> B <= 3.85 -> 3".
    naive = b.activation_bytes_seed003(48, 1024, 1600, 25, 50257)
    assert naive / 2**30 == pytest.approx(14.3, abs=0.05)
    assert b.max_micro_batch(80e9, states, naive) == 3


def test_gpt2_xl_109_hours_at_half_mfu() -> None:
    flops = b.train_flops(1_555_126_400, 400_000 * 1024)
    assert flops == pytest.approx(3.82e18, rel=0.005)  # the seed rounds P to 1.56e9: 3.834e18
    hours = b.train_seconds(flops, 19.5e12, 0.5) / 3600
    assert hours == pytest.approx(109, abs=0.5)  # 108.9 h; the seed's 109.2 h uses P = 1.56e9
    assert b.train_seconds(b.train_flops(1.56e9, 400_000 * 1024), 19.5e12, 0.5) / 3600 == pytest.approx(109.2, abs=0.05)


# -- seed 001: 7B memory, ZeRO, batch, MFU, bubble, checkpoints ---------------------------------


def test_7b_bf16_weights_and_fp32_adam_moments() -> None:
    r = b.RECIPES["bf16"]
    assert 7e9 * r.weight_bytes / 1e9 == 14
    assert 7e9 * 8 / 1e9 == 56  # two fp32 moments
    assert r.optimizer_bytes == 8
    assert b.model_state_bytes(7e9, "bf16") / 1e9 == 84


@pytest.mark.parametrize(("stage", "gb"), [(0, 84), (1, 35), (2, 22.75), (3, 10.5)])
def test_7b_zero_stages_on_8_ranks(stage: int, gb: float) -> None:
    assert b.model_state_bytes_per_rank(7e9, "bf16", stage, 8) / 1e9 == pytest.approx(gb)


def test_8b_mixed_precision_model_states_128gb() -> None:
    # seed 004: 8e9 x (2 + 2 + 4 + 8) = 128 GB; the ZeRO paper's K = 12 recipe.
    assert b.model_state_bytes(8e9, "mixed") / 1e9 == 128
    assert b.model_state_bytes(8e9, "fp16-mixed") / 1e9 == 128
    # seed 002's 20-byte bf16 recipe keeps fp32 gradients as well.
    assert b.RECIPES["bf16-mixed"].bytes_per_param == 20
    assert b.RECIPES["fp32"].bytes_per_param == 16


def test_tokens_per_step() -> None:
    assert b.tokens_per_step(2, 4096, 64, 8) == 4_194_304
    assert b.effective_batch_sequences(2, 64, 8) == 1024


def test_mfu_7b_300b_tokens_14_days() -> None:
    flops = b.train_flops(7e9, 300e9)
    assert flops == pytest.approx(1.26e22)
    assert round(b.mfu(flops, 14 * 86400, 312e12, 512), 3) == 0.065


def test_pipeline_bubble() -> None:
    assert b.pipeline_bubble_fraction(8, 4) == pytest.approx(7 / 11)
    assert b.pipeline_bubble_ratio(8, 4) == pytest.approx(7 / 4)  # seed 002's (p-1)/m: the same bubble
    r = b.pipeline_bubble_ratio(8, 4)
    assert r / (1 + r) == pytest.approx(b.pipeline_bubble_fraction(8, 4))
    # the notebook's printed table
    assert [round(b.pipeline_bubble_fraction(8, m), 3) for m in (1, 4, 16, 64)] == [0.875, 0.636, 0.304, 0.099]


def test_checkpoint_overhead_47_4_and_8_26_percent() -> None:
    assert round(100 * b.checkpoint_overhead(2.0, 180.0, 100), 1) == 47.4
    assert round(100 * b.checkpoint_overhead(2.0, 180.0, 1000), 2) == 8.26
    # seed 001 also prints 500 and 5000 steps
    assert round(100 * b.checkpoint_overhead(2.0, 180.0, 500), 2) == 15.25
    assert round(100 * b.checkpoint_overhead(2.0, 180.0, 5000), 2) == 1.77


def test_young_daly_interval() -> None:
    young = b.young_interval_seconds(180.0, 24 * 3600)
    assert young == pytest.approx(math.sqrt(2 * 180 * 86400))
    daly = b.daly_interval_seconds(180.0, 24 * 3600)
    assert abs(daly - young) / young < 0.05  # delta << MTBF: the refinement is small
    assert b.daly_interval_seconds(100.0, 10.0) == 10.0  # delta >= 2M: checkpoint every MTBF


def test_allreduce_cost() -> None:
    # seed 001 §9: latency + payload / bandwidth, 1 GB at 200 GB/s + 0.05 ms = 5.05 ms
    assert b.allreduce_seconds(1e9, 200e9, latency_seconds=0.05e-3) * 1e3 == pytest.approx(5.05)
    # ring on 8 ranks: 2 * 7/8 of the payload crosses each link
    assert b.allreduce_seconds(1e9, 200e9, ranks=8) == pytest.approx(2 * 7 / 8 * 1e9 / 200e9)


def test_activation_formula_is_the_papers() -> None:
    # Korthikanti et al.: s*b*h*(34 + 5*a*s/h) bytes per layer with 16-bit activations. Seed 002
    # drops the s in the second term; check the s^2 dependence that the paper has.
    s, bsz, h, a = 2048, 1, 4096, 32
    assert b.activation_bytes_per_layer(s, bsz, h, a) == pytest.approx(s * bsz * h * (34 + 5 * a * s / h))
    assert b.activation_bytes_per_layer(2 * s, bsz, h, a) > 2 * b.activation_bytes_per_layer(s, bsz, h, a)
    assert b.activation_bytes_per_layer(s, bsz, h, a, value_bytes=4) == pytest.approx(
        s * bsz * h * (66 + 9 * a * s / h)
    )


def test_flops_per_token_one_definition() -> None:
    assert b.training_flops_per_token is training_flops_per_token
    assert training_flops_per_token(1e9) == 6e9
    assert training_flops_per_token(1e9, 2, 64, 32) == 6e9 + 12 * 2 * 64 * 32
    assert b.mfu_from_throughput(1000.0, 6e9, 312e12) == pytest.approx(1000 * 6e9 / 312e12)


def test_peak_flops_table() -> None:
    assert peak_flops_for("NVIDIA A100-SXM4-80GB", "bf16") == 312e12
    assert peak_flops_for("NVIDIA A100 80GB PCIe", "fp32") == 19.5e12
    assert peak_flops_for("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert peak_flops_for("NVIDIA H100 PCIe", "bf16") == 756e12
    assert peak_flops_for("NVIDIA A10", "bf16") == 125e12
    assert peak_flops_for("NVIDIA A10G", "bf16") is None  # not A10, not A100
    assert peak_flops_for("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 on Volta
    assert peak_flops_for("Some Future GPU", "bf16") is None


def test_parsing_units() -> None:
    assert b.parse_bytes("80GB") == 80e9
    assert b.parse_bytes("80GiB") == 80 * 2**30
    assert b.parse_number("7B") == 7e9
    assert b.parse_number("312T") == 312e12
    assert b.parse_number("19.5TFLOPS") == 19.5e12
    assert b.parse_number("400k") == 4e5
    with pytest.raises(b.BudgetError, match="--gpu-memory"):
        b.parse_bytes("80", "--gpu-memory")


# -- the CLI -------------------------------------------------------------------------------------


def _budget_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["budget", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_issue_example_subprocess() -> None:
    """The issue's example command, run as a script runs it."""
    cmd = [
        sys.executable,
        "-m",
        "trainmon.monitor.cli",
        "budget",
        "--layers",
        "48",
        "--d-model",
        "1600",
        "--vocab",
        "50257",
    ]
    cmd += ["--heads", "25", "--seq", "1024", "--precision", "fp32", "--gpu-memory", "80GB", "--json"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    out = json.loads(proc.stdout)
    assert out["params"] == 1_555_126_400
    assert out["model_state_bytes"] == 16 * 1_555_126_400
    assert out["activation_bytes_per_sequence"] > 0
    assert out["max_micro_batch"] == 3


def test_cli_flops_mfu_bubble_checkpoint(capsys: pytest.CaptureFixture[str]) -> None:
    out = _budget_json(
        capsys, "--params", "7B", "--tokens", "300B", "--gpus", "512", "--peak-flops", "312T", "--days", "14"
    )
    assert out["train_flops"] == pytest.approx(1.26e22)
    assert round(out["mfu"], 3) == 0.065
    out = _budget_json(capsys, "--stages", "8", "--micro-batches", "4")
    assert out["bubble_fraction"] == pytest.approx(7 / 11)
    out = _budget_json(capsys, "--step-seconds", "2", "--checkpoint-seconds", "180", "--checkpoint-every", "100")
    assert round(out["checkpoint_overhead"], 3) == 0.474
    out = _budget_json(
        capsys, "--step-seconds", "2", "--checkpoint-seconds", "180", "--checkpoint-every", "1000", "--mtbf-hours", "24"
    )
    assert round(out["checkpoint_overhead"], 4) == 0.0826
    assert out["optimal_checkpoint_every"] == round(math.sqrt(2 * 180 * 86400) / 2)
    out = _budget_json(capsys, "--params", "1555126400", "--tokens", "409.6M", "--peak-flops", "19.5T", "--mfu", "0.5")
    assert out["train_hours"] == pytest.approx(109, abs=0.5)


def test_cli_zero_and_batch(capsys: pytest.CaptureFixture[str]) -> None:
    out = _budget_json(capsys, "--params", "7B", "--precision", "bf16", "--zero", "2", "--ranks", "8")
    assert out["model_state_bytes_per_rank"] == pytest.approx(22.75e9)
    out = _budget_json(capsys, "--params", "8B", "--precision", "mixed")
    assert out["model_state_bytes"] == pytest.approx(128e9)
    out = _budget_json(capsys, "--micro-batch", "2", "--seq", "4096", "--ranks", "64", "--grad-accum", "8")
    assert out["tokens_per_step"] == 4_194_304


def test_cli_human_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["budget", *(f"--{k.replace('_', '-')}={v}" for k, v in GPT2_XL.items()), "--gpu-memory", "80GB"]) == 0
    text = capsys.readouterr().out
    assert "1,555,126,400" in text
    assert "max micro batch" in text


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--layers", "48", "--d-model", "1600", "--vocab", "50257", "--gpu-memory", "80"], "--gpu-memory"),
        (["--layers", "48"], "--d-model"),
        (["--params", "seven"], "--params"),
        (["--params", "7B", "--zero", "3"], "--ranks"),
        (["--stages", "8"], "--micro-batches"),
        (["--params", "7B", "--tokens", "300B", "--days", "14"], "--peak-flops"),
        (["--step-seconds", "2", "--checkpoint-every", "100"], "--checkpoint-seconds"),
        (["--step-seconds", "2", "--checkpoint-seconds", "180", "--checkpoint-every", "0"], "--checkpoint-every"),
        ([], "nothing to compute"),
    ],
)
def test_cli_bad_flags_name_the_flag(capsys: pytest.CaptureFixture[str], args: list[str], flag: str) -> None:
    assert main(["budget", *args]) == 2
    err = capsys.readouterr().err
    assert flag in err
    assert err.startswith("trainmon budget:")


def test_cli_argparse_errors_name_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["budget", "--layers", "many"])
    assert exc.value.code == 2
    assert "--layers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["budget", "--precision", "fp7"])
    assert "--precision" in capsys.readouterr().err


def test_gpu_memory_with_params_only_says_what_it_can(capsys: pytest.CaptureFixture[str]) -> None:
    """7B in fp32 against an 80 GB GPU: 112 GB of model states do not fit, 32 GB short; the
    micro-batch needs the shape and is simply not printed."""
    assert main(["budget", "--params", "7B", "--gpu-memory", "80GB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["gpu_memory_left_bytes"] == pytest.approx(-32e9) and out["model_states_fit"] is False
    assert "max_micro_batch" not in out


def test_printed_budget_cites_sources_and_units(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["budget", "--layers", "48", "--d-model", "1600", "--vocab", "50257", "--seq", "1024", "--heads", "25"]
    assert main([*args, "--step-seconds", "2", "--checkpoint-seconds", "60", "--mtbf-hours", "24"]) == 0
    text = capsys.readouterr().out
    assert "seed" not in text.lower()
    assert "1,610 steps" in text and "Young 1974" in text.replace("\n", " ").replace("│", " ").replace("  ", " ")


def test_large_counts_read_like_the_inputs(capsys: pytest.CaptureFixture[str]) -> None:
    """'--tokens 1T' came back as 'tokens 1e+12' and 'flops per token 4.2e+10': the one number format
    has no exponents below 1e15; counts take the suffixes the flags take."""
    assert main(["budget", "--params", "7B", "--tokens", "1T", "--gpus", "8", "--peak-flops", "312T"]) == 0
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in capsys.readouterr().out.splitlines()
            if line.count("│") >= 3}  # fmt: skip
    assert rows["tokens"] == "1T" and rows["flops per token"] == "42B" and rows["peak flops per gpu"] == "312T"
    assert rows["train flops"] == "4.2e+22"  # beyond T: FLOPs in exponent form, as papers write them
