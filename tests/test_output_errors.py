"""No traceback from any output path: a write the system refuses after every check passed (a full
disk, a folder made read-only) ends each command with one line and exit 2.

The refusal is simulated: every `open` for writing under the output folder raises the OSError the
kernel would (ENOSPC, EROFS), so the test runs as any user, root included (root writes through
permissions). Special files where an output goes (FIFOs, devices) are corpus cases
(tests/inputs/outputs/*fifo*, *dev_null*).
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvsim.cli import main
from kvsim.report import outputs
from kvsim.report.outputs import LOCK_FILE, lock_output_dir, release_output_lock
from tests.helpers import ROOT, run_guarded

TRACE = "arrival_s,prompt_tokens,output_tokens\n0,64,8\n0.5,128,16\n1.0,32,4\n"
SCENARIO = """model: llama-3.1-8b
cluster: {gpu: h100-sxm, gpus_per_node: 1}
workload: {trace: trace.csv, format: generic}
"""


def _refuse_writes_under(
    monkeypatch: pytest.MonkeyPatch, folder: Path, code: int, name: str | None = None
) -> None:
    """Writes under `folder` (only to files whose name holds `name`: temporary ones too, if given) raise `code`."""
    real = io.open
    root = str(folder.resolve())

    def guarded(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if isinstance(file, str | os.PathLike) and any(c in mode for c in "wax+"):
            path = os.path.abspath(os.fspath(file))
            if path.startswith(root) and (name is None or name in os.path.basename(path)):
                raise OSError(code, os.strerror(code), os.fspath(file))
        return real(file, mode, *args, **kwargs)

    monkeypatch.setattr(io, "open", guarded)
    monkeypatch.setattr(builtins, "open", guarded)


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "trace.csv").write_text(TRACE)
    (tmp_path / "scenario.yaml").write_text(SCENARIO)
    monkeypatch.chdir(tmp_path)
    return tmp_path


COMMANDS = {
    "run": ["run", "scenario.yaml", "--out", "out", "--no-progress"],
    "sweep": ["sweep", "scenario.yaml", "--grid", "kv.format=bf16,fp8", "--out", "out", "--jobs", "1"],
    "plan": ["plan", "scenario.yaml", "--slo", "ttft_p99=10s", "--out", "out", "--jobs", "1"],
    "stack": ["stack", "scenario.yaml", "--out", "out", "--no-progress"],
}
# (command, the file whose write fails: None for every file, so the first write fails)
CASES = [
    *((c, None) for c in COMMANDS),
    ("run", "requests.csv"),
    ("run", "report.html"),
    ("sweep", "results.csv"),
    ("sweep", "sweep.html"),
    ("plan", "plan.json"),
    ("plan", "plan.html"),
    ("stack", "stack.html"),
]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS], ids=["disk-full", "read-only"])
@pytest.mark.parametrize(("command", "name"), CASES, ids=[f"{c}-{n or 'all'}" for c, n in CASES])
def test_a_refused_write_is_one_line_and_exit_2(folder: Path, monkeypatch, capsys, command, name, code):
    argv = COMMANDS[command]
    if command in ("sweep", "plan"):
        argv = [*argv, "--no-progress"]
    (folder / "out").mkdir()
    _refuse_writes_under(monkeypatch, folder / "out", code, name)
    assert main(argv) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1, err
    assert err[0].startswith("kvsim: error: ") and os.strerror(code) in err[0], err


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS], ids=["disk-full", "read-only"])
def test_report_and_compare_writes_refused(folder: Path, monkeypatch, capsys, code):
    assert main(COMMANDS["run"]) == 0
    capsys.readouterr()
    _refuse_writes_under(monkeypatch, folder / "out", code)
    assert main(["report", "out"]) == 2
    (folder / "cmp").mkdir()
    _refuse_writes_under(monkeypatch, folder / "cmp", code)
    assert main(["report", "out", "out2", "--out", "cmp/page.html"]) == 2  # out2 missing: input first
    assert main(["report", "out", "--out", "cmp/page.html"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 3 and all(ln.startswith("kvsim: error: ") for ln in err), err
    assert os.strerror(code) in err[0] and os.strerror(code) in err[2], err


def test_calibrate_import_write_refused(tmp_path: Path, monkeypatch, capsys):
    pytest.importorskip("aiconfigurator_core", reason="aiconfigurator-core is not installed")
    pytest.importorskip("pyarrow")
    from calibrate.cli import main as calibrate_main

    _refuse_writes_under(monkeypatch, tmp_path, errno.ENOSPC)
    argv = ["import", "--from-aiconfigurator", "--model", "llama-3.1-8b", "--out", str(tmp_path / "p.json")]
    assert calibrate_main(argv) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and os.strerror(errno.ENOSPC) in err[0], err


# One writer per output folder (kvsim.report.outputs.lock_output_dir): a second kvsim on a folder
# being written is one line and exit 2; a lock left by a dead process is taken over.
LOCKED = {
    **{c: [*argv, "--no-progress"] if c in ("sweep", "plan") else argv for c, argv in COMMANDS.items()},
    "validate": [
        "validate",
        "--device",
        "cpu",
        "--quick",
        "--scenario",
        "v.yaml",
        "--out",
        "out",
        "--no-progress",
    ],
}
HOLD = """import sys, time
from kvsim.report.outputs import check_output_dir
check_output_dir(sys.argv[1], reads=(), force=False)
print("held", flush=True)
time.sleep(3600)
"""


def _kvsim(folder: Path, argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return run_guarded(
        [sys.executable, "-m", "kvsim", *argv], capture_output=True, text=True, cwd=folder, env=env
    )


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("command", list(LOCKED))
def test_a_second_writer_of_a_folder_is_one_line_and_writes_nothing(folder: Path, command: str):
    shutil.copy(ROOT / "scenarios" / "validate_burst.yaml", folder / "v.yaml")
    (folder / "traces" / "validate").mkdir(parents=True)  # what v.yaml reads, beside it
    shutil.copy(ROOT / "scenarios" / "traces" / "validate" / "burst.csv", folder / "traces" / "validate")
    out = folder / "out"
    out.mkdir()
    assert lock_output_dir(out)  # this test process is the first writer
    try:
        before = _files(folder)
        assert before["out/.kvsim.lock"] == f"{os.getpid()}\n".encode()
        proc = _kvsim(folder, LOCKED[command])
        assert _files(folder) == before  # nothing written, the holder's lock untouched
    finally:
        release_output_lock(out)
    assert proc.returncode == 2, proc.stderr
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert err == [
        f"kvsim: error: --out: out: another kvsim (pid {os.getpid()}) is writing it;"
        " wait for it to end or choose another --out"
    ]
    assert not (out / LOCK_FILE).exists()  # released: the file goes with the lock


def test_the_lock_of_a_killed_kvsim_is_taken_over(folder: Path, capsys):
    out = folder / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        assert main(COMMANDS["run"]) == 2  # while it lives
        assert f"another kvsim (pid {holder.pid}) is writing it" in capsys.readouterr().err
    finally:
        holder.kill()  # SIGKILL: no clean-up runs; the kernel drops the flock
        holder.wait()
    assert (out / LOCK_FILE).read_text() == f"{holder.pid}\n"  # stale: left behind with a dead pid
    assert main(COMMANDS["run"]) == 0
    assert (out / "summary.json").is_file() and not (out / LOCK_FILE).exists()


def test_the_lock_is_the_processs_own_and_a_forked_child_does_not_hold_it(tmp_path: Path):
    assert lock_output_dir(tmp_path) and not lock_output_dir(tmp_path)  # held: a second take is a no-op
    try:
        pid = os.fork()
        if pid == 0:  # the child: its copy of the lock forgotten, so its exit cannot release it
            os._exit(len(outputs._HELD))
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        hold = subprocess.run(  # another process, after the child's exit: the lock is still held
            [sys.executable, "-c", HOLD.replace("time.sleep(3600)", ""), str(tmp_path)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert hold.returncode == 1 and "another kvsim" in hold.stderr
    finally:
        release_output_lock(tmp_path)
    assert not (tmp_path / LOCK_FILE).exists()
