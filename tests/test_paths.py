"""The one path rule's pieces the corpus (tests/inputs/paths/) cannot reach cheaply: `kvsim
validate` with a relative --out reads back the scaled model it wrote, and a refused validation
removes the folders it created. The calibration child is replaced by a stub that fails the way a
refused calibration does (one line, exit 2), so no torch is needed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvsim import validation
from kvsim.cli import main
from kvsim.errors import KvsimError


def test_validate_relative_out_reads_its_model_and_leaves_nothing_when_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.chdir(tmp_path)
    seen: list[tuple[Path, bool]] = []

    def child(module: str, argv: list[str], what: str, **kw: Any) -> None:
        model = Path(argv[argv.index("--model") + 1])
        seen.append((model, model.is_file()))
        raise KvsimError("the calibration refused its input", source="kvsim validate")

    monkeypatch.setattr(validation, "_child", child)
    code = main(["validate", "--device", "cpu", "--quick", "--out", "reports/validate", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.strip() == "kvsim: error: validate: the calibration refused its input"
    # Before the fix the scaled model was read relative to scenarios/ and this was exit 2 earlier,
    # with reports/validate/model/ left behind.
    [(model, existed)] = seen
    assert model.is_absolute() and existed
    assert model.is_relative_to(tmp_path / "reports" / "validate")
    assert not (tmp_path / "reports").exists()  # the outermost folder the command created


def test_validate_refused_into_an_existing_folder_keeps_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "notes.txt").write_text("mine\n")

    def child(module: str, argv: list[str], what: str, **kw: Any) -> None:
        raise KvsimError("the calibration refused its input", source="kvsim validate")

    monkeypatch.setattr(validation, "_child", child)
    assert main(["validate", "--device", "cpu", "--quick", "--out", "reports/v", "--no-progress"]) == 2
    capsys.readouterr()
    assert sorted(p.name for p in (tmp_path / "reports").iterdir()) == ["notes.txt"]
