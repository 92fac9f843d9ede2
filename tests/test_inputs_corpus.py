"""The bad- and edge-input corpus (tests/inputs/README.md): every case runs in-process, in its own
folder, and must end as it states. A bad input must give exit 2 and one line of at most 300
characters naming the file and the field or line; it must neither hang nor change any file. A valid
edge input must run (exit 0) with the numbers it states, and write a strictly valid summary.json.
Silent acceptance of a bad input fails here, because each bad case states the error it expects.
"""

from __future__ import annotations

import copy
import json
import math
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers import HANG_GUARD_S, hang_message

ROOT = Path(__file__).resolve().parent.parent
CORPUS = Path(__file__).parent / "inputs"
CASES = sorted(p for p in CORPUS.rglob("*.yaml"))
CASE_KEYS = {
    "about",
    "files",
    "scenario",
    "scenario_text",
    "argv",
    "exit",
    "error",
    "summary",
    "below",
    "changes",
}
BASE_SCENARIO: dict[str, Any] = {
    "model": "llama-3.1-8b",
    "cluster": {"gpu": "h100-sxm", "gpus_per_node": 1},
    "workload": {"trace": "trace.csv", "format": "generic"},
}
BASE_TRACE = "arrival_s,prompt_tokens,output_tokens\n0,64,8\n0.5,128,16\n1.0,32,4\n"
DEFAULT_ARGV = ["run", "scenario.yaml", "--out", "out", "--no-progress"]
TMP = "<tmp>"  # in argv and text files: the case's folder, for absolute paths
MAX_LINE = 300


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` deep-merged into a copy of `base`; a null value removes the key."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def _set(data: Any, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    for k in keys[:-1]:
        data = data[int(k)] if isinstance(data, list) else data[k]
    last = keys[-1]
    if isinstance(data, list):
        data[int(last)] = value
    elif value == "<delete>":
        del data[last]
    else:
        data[last] = value


def _content(spec: Any) -> bytes:
    """A file's bytes from its spec: text, or {text, encoding} / {hex} / {repeat, times, head, tail}
    / {json} / {copy, set, replace} (a file of the repository, edited)."""
    if isinstance(spec, str):
        return spec.encode("utf-8")
    assert isinstance(spec, dict), spec
    if "text" in spec:
        return str(spec["text"]).encode(spec.get("encoding", "utf-8"))
    if "hex" in spec:
        return bytes.fromhex(spec["hex"])
    if "repeat" in spec:
        body = str(spec["repeat"]) * int(spec["times"])
        return (spec.get("head", "") + body + spec.get("tail", "")).encode()
    if "json" in spec:
        return json.dumps(spec["json"]).encode()
    if "copy" in spec:
        text = (ROOT / spec["copy"]).read_text()
        if "set" in spec:
            data = json.loads(text)
            for dotted, value in spec["set"].items():
                _set(data, dotted, value)
            text = json.dumps(data)
        for old, new in spec.get("replace", []):
            assert old in text, f"replace: {old!r} not in {spec['copy']}"
            text = text.replace(old, new, 1)
        return text.encode()
    raise AssertionError(f"unknown file spec {spec!r}")


def _prepare(case: dict[str, Any], tmp: Path) -> None:
    files = case.get("files") or {}
    if "trace.csv" not in files:
        (tmp / "trace.csv").write_text(BASE_TRACE)
    for name, spec in files.items():
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(spec, str):
            path.write_bytes(spec.replace(TMP, str(tmp)).encode("utf-8"))
        elif isinstance(spec, dict) and "mkdir" in spec:
            path.mkdir(exist_ok=True)
        elif isinstance(spec, dict) and "symlink" in spec:
            path.symlink_to(spec["symlink"])
        else:
            path.write_bytes(_content(spec))
    if "scenario_text" in case:
        (tmp / "scenario.yaml").write_text(case["scenario_text"])
    elif not (tmp / "scenario.yaml").exists():
        data = _merge(BASE_SCENARIO, case.get("scenario") or {})
        (tmp / "scenario.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


def _snapshot(tmp: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(tmp)): p.read_bytes()
        for p in sorted(tmp.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


class _Hang(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Hang


def _run(argv: list[str]) -> int:
    if argv[0] == "calibrate":
        from calibrate.cli import main as calibrate_main

        return calibrate_main(argv[1:])
    from kvsim.cli import main

    return main(argv)


def _strict_json(text: str) -> Any:
    def refuse(name: str) -> None:
        raise AssertionError(f"summary.json holds {name}: not valid JSON")

    return json.loads(text, parse_constant=refuse)


def _lookup(data: Any, dotted: str) -> Any:
    for k in dotted.split("."):
        data = data[int(k)] if isinstance(data, list) else data[k]
    return data


def _ids() -> Iterator[str]:
    for p in CASES:
        yield str(p.relative_to(CORPUS).with_suffix(""))


@pytest.mark.parametrize("path", CASES, ids=list(_ids()))
def test_input_case(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    case = yaml.safe_load(path.read_text())
    assert isinstance(case, dict) and set(case) <= CASE_KEYS, f"{path.name}: keys {sorted(case)}"
    assert isinstance(case.get("about"), str), f"{path.name}: say what the case is in `about`"
    want_exit = case.get("exit", 2)
    assert want_exit == 0 or isinstance(case.get("error"), str), f"{path.name}: a bad case states its error"
    _prepare(case, tmp_path)
    monkeypatch.chdir(tmp_path)
    before = _snapshot(tmp_path)
    argv = [str(a).replace(TMP, str(tmp_path)) for a in case.get("argv", DEFAULT_ARGV)]
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(math.ceil(HANG_GUARD_S))
    try:
        code = _run(argv)
    except _Hang:
        pytest.fail(f"{path.name}: {hang_message('the case')}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    err = capsys.readouterr().err
    after = _snapshot(tmp_path)
    allowed = set(case.get("changes", []))
    changed = [k for k, v in before.items() if after.get(k) != v and k not in allowed]
    assert not changed, f"{path.name}: changed inputs {changed}"
    if want_exit != 0:
        assert code == want_exit, f"{path.name}: exit {code}, stderr {err!r}"
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1, f"{path.name}: expected one line, got {lines}"
        line = lines[0]
        assert len(line) <= MAX_LINE, f"{path.name}: {len(line)} characters: {line[:200]}..."
        assert line.startswith("kvsim: error: ") and not line.startswith("kvsim: error: kvsim"), line
        assert case["error"] in line, f"{path.name}: expected {case['error']!r} in {line!r}"
        created = sorted(set(after) - set(before))
        assert not created, f"{path.name}: a refused command wrote {created}"
        return
    assert code == 0, f"{path.name}: exit {code}, stderr {err!r}"
    summary_path = tmp_path / "out" / "summary.json"
    if summary_path.exists():
        summary = _strict_json(summary_path.read_text())
        for dotted, value in (case.get("summary") or {}).items():
            got = _lookup(summary, dotted)
            assert got == pytest.approx(value), f"{path.name}: {dotted} = {got!r}, expected {value!r}"
        for dotted, bound in (case.get("below") or {}).items():
            got = _lookup(summary, dotted)
            assert 0 <= got < bound, f"{path.name}: {dotted} = {got!r}, expected below {bound!r}"
    else:
        assert not case.get("summary") and not case.get("below"), f"{path.name}: no summary.json written"


def test_corpus_covers_every_kind_of_input() -> None:
    groups = {p.relative_to(CORPUS).parts[0] for p in CASES}
    assert groups >= {"traces", "models", "profiles", "scenarios", "overrides", "flags", "outputs"}
    assert len(CASES) >= 100
    fmts = " ".join(p.read_text() for p in (CORPUS / "traces").rglob("*.yaml"))
    for fmt in ("mooncake", "azure", "burstgpt", "vidur", ".jsonl", ".csv"):
        assert fmt in fmts, f"no trace case for {fmt}"
