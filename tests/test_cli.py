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


def test_kv_size_table_piped_is_not_cut(capsys):
    """capsys is not a terminal: rich would assume 80 columns and cut the title and cells."""
    assert main(["kv-size", "--model", "llama-3.1-70b", "--context", "1M"]) == 0
    out = capsys.readouterr().out
    assert "8 x h100-sxm = 684.17 GB" in out  # the end of the title, past column 80
    assert "vs fp16" in out and "343.60 GB" in out and "…" not in out
    assert max(len(line) for line in out.splitlines()) > 80


def test_version_from_package_metadata(capsys):
    from kvsim import __version__

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvsim {__version__}"  # pyproject's version, the same


def test_calibrate_help_lists_import():
    proc = subprocess.run(
        [sys.executable, "-m", "kvsim", "calibrate", "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0
    assert "kvsim calibrate import --from-aiconfigurator" in proc.stdout
    assert "import --help" in proc.stdout


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["run"], "kvsim: error: run: the following arguments are required: scenario, --out"),
        (["frobnicate"], "kvsim: error: argument command: invalid choice"),
        (["plan", "s.yaml", "--out", "o", "--search", "x=1,2"], "kvsim: error: "),
        (["sweep", "s.yaml", "--out", "o"], "kvsim: error: "),
        (["stack", "nope.yaml"], "kvsim: error: nope.yaml: file not found"),
        (["report", "nope"], "kvsim: error: nope: run directory not found"),
        (["validate", "--device", "tpu", "--out", "o"], "kvsim: error: validate: argument --device"),
        (["calibrate", "--device", "cpu"], "kvsim: error: calibrate: the following arguments are required"),
        (["calibrate", "import", "--model", "x"], "kvsim: error: calibrate import: the following"),
    ],
)
def test_every_subcommand_error_starts_with_one_kvsim_prefix(argv, needle, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "kvsim", *argv], capture_output=True, text=True, cwd=tmp_path
    )
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert "\n" not in err and err.startswith(needle), err
    assert not err.removeprefix("kvsim: error: ").startswith("kvsim"), err  # one prefix, not doubled
