"""Scenario corpora: every valid/ file loads; every invalid/ file fails with the error it states."""

from pathlib import Path

import pytest

from kvsim.errors import KvsimError
from kvsim.spec.scenario import load_scenario

HERE = Path(__file__).parent / "scenarios"
VALID = sorted((HERE / "valid").glob("*.yaml"))
INVALID = sorted((HERE / "invalid").glob("*.yaml"))
SHIPPED = sorted((Path(__file__).parent.parent / "scenarios").rglob("*.yaml"))


@pytest.mark.parametrize("path", VALID + SHIPPED, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_valid(path):
    sc = load_scenario(path)
    assert sc.model.num_layers > 0


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_invalid(path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# error: "), f"{path.name} must state its expected error on line 1"
    expected = first[len("# error: ") :]
    with pytest.raises(KvsimError) as ei:
        load_scenario(path)
    msg = str(ei.value)
    assert msg.startswith(str(path)), msg  # names the file
    assert expected in msg, msg
    assert "\n" not in msg


def test_corpus_is_not_empty():
    assert len(VALID) >= 4 and len(INVALID) >= 20


def test_override_uses_same_paths_and_validation():
    path = HERE / "valid" / "minimal.yaml"
    sc = load_scenario(path, ["kv.format=fp8", "kv.block_size=32", "cluster.gpu.hbm=40GiB"])
    assert sc.kv.format.name == "fp8_e4m3/per_tensor"
    assert sc.kv.block_size == 32
    assert sc.cluster.gpu.hbm_bytes == 40 * 2**30
    with pytest.raises(KvsimError, match=r"\(--set\): kv.block_size: must be a power of two"):
        load_scenario(path, ["kv.block_size=24"])
    with pytest.raises(KvsimError, match="kv.formt: unknown key"):
        load_scenario(path, ["kv.formt=fp8"])


def test_alias_note_for_turboquant():
    sc = load_scenario(HERE / "valid" / "turboquant_alias.yaml")
    assert sc.kv.format.kind.value == "kvquant4"
    assert "KVQuant" in (sc.kv.format_note or "")


def test_model_attention_overrides():
    path = HERE / "valid" / "minimal.yaml"
    sc = load_scenario(path, ["model.name=llama-3.1-8b", "model.kv_layer_group=2"])
    assert sc.model.kv_bytes_per_token(sc.kv.format) == 131072 // 2
    sc = load_scenario(
        path, ["model.name=llama-3.1-8b", "model.sliding_window=1024", "model.global_tokens=4"]
    )
    assert sc.model.kv_bytes(100_000, sc.kv.format) == 1028 * 131072
    with pytest.raises(KvsimError, match="model.kv_layer_group: expected an integer in"):
        load_scenario(path, ["model.name=llama-3.1-8b", "model.kv_layer_group=0"])
