"""The README's tour runs as written (README.md, "A tour"), top to bottom, in a fresh folder; and
the README's Python example runs. Both are read from README.md, so they cannot drift from it.

Each command runs as the README writes it, changed only by these rules (stated once, here), so
that the whole tour takes well under two minutes on a 2-core CPU:

1. The folder holds ``scenarios/``: every scenario file of the repository's ``scenarios/`` copied
   with ``workload.max_requests: 100`` (``validate.yaml``: 12), its traces, profiles and models
   linked to the repository's. Every run replays the start of its real trace. ``tests/data`` is
   linked too (the made-up ShareGPT and vLLM bench files the tour names).
2. ``kvsim validate`` (not ``--against``, which executes nothing) gets ``--repeats 1`` and, unless
   it names one, ``--scenario scenarios/validate.yaml`` (the shortened copy of its default scenario).
3. ``kvsim calibrate --device cuda`` runs with ``--device cpu --ops copy`` where torch sees no GPU
   (the GEMM timings alone take a minute on a CPU).
4. ``--executor ray`` is skipped where Ray is not installed, and ``calibrate import
   --from-aiconfigurator`` where the ``aiconfigurator`` extra is not (the tour's later commands
   read neither's output).

Every command must exit 0, and the ones that name an output must write it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

from tests.helpers import ROOT

README = ROOT / "README.md"
MAX_REQUESTS = {"validate.yaml": 12}
DEFAULT_MAX_REQUESTS = 100
GUARD_S = 600  # a guard against a hang, not a timing target: the whole tour takes about a minute


def _section(title: str) -> str:
    text = README.read_text(encoding="utf-8")
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", text, flags=re.S | re.M)
    assert m, f"README.md has no section {title!r}"
    return m.group(1)


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def tour_commands() -> list[list[str]]:
    """The tour's commands, as argument lists: continuation lines joined, comments dropped."""
    [block] = _blocks(_section("A tour"), "bash")
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        argv = shlex.split(line, comments=True)
        if argv:
            commands.append(argv)
    return commands


def python_example() -> str:
    blocks = _blocks(README.read_text(encoding="utf-8"), "python")
    [code] = [b for b in blocks if "import kvsim" in b]
    return code


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _cuda() -> bool:
    if not _has("torch"):
        return False
    import torch

    return bool(torch.cuda.is_available())


def _fresh_folder(tmp: Path) -> None:
    """Rule 1: ``tmp/scenarios``, each scenario file shortened, its data linked."""
    src = ROOT / "scenarios"
    dst = tmp / "scenarios"
    dst.mkdir()
    for entry in src.iterdir():
        if entry.suffix == ".yaml":
            data = yaml.safe_load(entry.read_text())
            data["workload"]["max_requests"] = MAX_REQUESTS.get(entry.name, DEFAULT_MAX_REQUESTS)
            (dst / entry.name).write_text(yaml.safe_dump(data, sort_keys=False))
        else:
            (dst / entry.name).symlink_to(entry)
    (tmp / "tests").mkdir()
    (tmp / "tests" / "data").symlink_to(ROOT / "tests" / "data")


def _adapt(argv: list[str]) -> list[str] | str:
    """Rules 2-4: the command to run, or why it is skipped."""
    assert argv[0] == "kvsim", f"a tour line that is not a kvsim command: {argv}"
    args = argv[1:]
    if args[0] == "validate" and "--against" not in args:
        extra = ["--repeats", "1"]
        if "--scenario" not in args:
            extra += ["--scenario", "scenarios/validate.yaml"]
        return [*args, *extra]
    if args[0] == "calibrate" and args[1:2] == ["import"]:
        return args if _has("aiconfigurator") else "the aiconfigurator extra is not installed"
    if args[0] == "calibrate" and "cuda" in args and not _cuda():
        return [*("cpu" if a == "cuda" else a for a in args), "--ops", "copy"]
    if "--executor" in args and args[args.index("--executor") + 1] == "ray" and not _has("ray"):
        return "Ray is not installed"
    return args


def _outputs(args: list[str]) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--out"]


def test_the_tour_names_the_runs_it_compares() -> None:
    """A report over run directories follows the commands that write them."""
    written: set[str] = set()
    for argv in tour_commands():
        args = argv[1:]
        if args[0] == "report":
            dirs = [a for a in args[1:] if not a.startswith("--") and a not in _outputs(args)]
            missing = [d for d in dirs if d not in written]
            assert not missing, f"{shlex.join(argv)}: no earlier tour command writes {missing}"
        written.update(_outputs(args))


def test_the_tour_runs_as_written(tmp_path: Path) -> None:
    _fresh_folder(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    skipped = []
    for argv in tour_commands():
        args = _adapt(argv)
        if isinstance(args, str):
            skipped.append(f"{shlex.join(argv)}: {args}")
            continue
        proc = subprocess.run(
            [sys.executable, "-m", "kvsim", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=GUARD_S,
        )
        assert proc.returncode == 0, f"{shlex.join(argv)}\n-> {shlex.join(args)}\n{proc.stderr[-2000:]}"
        for out in _outputs(args):
            assert (tmp_path / out).exists(), f"{shlex.join(argv)}: wrote no {out}"
    assert len(skipped) <= 2, skipped


def test_the_python_example_runs(tmp_path: Path) -> None:
    (tmp_path / "scenarios").symlink_to(ROOT / "scenarios")  # the example shortens its own run
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", python_example()],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=GUARD_S,
    )
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.splitlines()
    assert re.fullmatch(r"500 done, TTFT p99 \d+\.\d{3} s, \$\d+\.\d{3}/Mtok", first), first
    assert second in ("True", "False")
    assert (tmp_path / "reports" / "api" / "summary.json").is_file()
