"""The CLI contract: kv-size JSON, one-line errors with exit code 2."""

import json
import subprocess
import sys

import pytest

from kvsim.cli import main


def test_kv_size_json_contract(capsys):
    rc = main(["kv-size", "--model", "llama-3.1-70b", "--format", "fp16", "--context", "131072", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bytes_per_token"] == 327_680
    assert out["total_bytes"] == 327_680 * 131_072
    assert out["rows"][0]["fits"] is True  # 141 GB weights + 43 GB KV on 8 x 80 GB


def test_kv_size_table_runs(capsys):
    assert main(["kv-size", "--model", "deepseek-v3", "--context", "128K", "--gpu", "h200"]) == 0
    assert "deepseek-v3" in capsys.readouterr().out


def test_kv_size_alias_note(capsys):
    assert main(["kv-size", "--format", "turboquant", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rows"][0]["format"].startswith("kvquant4")
    assert any("KVQuant" in n for n in out["notes"])


@pytest.mark.parametrize(
    "argv,needle",
    [
        (
            ["kv-size", "--model", "lama-3.1-8b"],
            "--model: unknown model 'lama-3.1-8b'; did you mean llama-3.1-8b",
        ),
        (["kv-size", "--format", "fp7"], "--format: unknown KV format 'fp7'"),
        (["kv-size", "--context", "-5"], "argument --context: expected a positive integer"),
        (["kv-size", "--gpu", "h900"], "--gpu: unknown GPU 'h900'"),
        (["kv-size", "--model", "missing/config.json"], "model config file not found"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_errors_are_one_line_exit_2(argv, needle):
    proc = subprocess.run([sys.executable, "-m", "kvsim", *argv], capture_output=True, text=True)
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert needle in err, err
    assert "\n" not in err and "Traceback" not in err


def test_kv_size_shows_accuracy_estimates_for_lossy_formats(capsys):
    assert main(["kv-size", "--format", "bf16", "--format", "int4", "--json"]) == 0
    acc = json.loads(capsys.readouterr().out)["accuracy"]
    assert [a["format"] for a in acc] == ["int4/g64"]  # bf16 is not lossy
    assert acc[0]["estimate_only"] is True
    assert acc[0]["kernel_rel_rms"] > 0 and acc[0]["literature"]
