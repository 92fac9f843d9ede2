"""KV bytes and parameter counts against hand arithmetic, for every preset."""

import json

import pytest

from kvsim.errors import KvsimError
from kvsim.spec.formats import make_format
from kvsim.spec.models import PRESETS, Attention, from_hf_config, load_model

FP16 = make_format("fp16")[0]

# 2 (K and V) x layers x kv_heads x head_dim x 2 bytes; MLA: layers x (kv_lora_rank + rope) x 2.
HAND = {
    "llama-3.1-8b": 2 * 32 * 8 * 128 * 2,  # 131,072
    "llama-3.1-70b": 2 * 80 * 8 * 128 * 2,  # 327,680
    "llama-3.1-405b": 2 * 126 * 8 * 128 * 2,  # 516,096
    "qwen2.5-7b": 2 * 28 * 4 * 128 * 2,  # 57,344
    "qwen2.5-72b": 2 * 80 * 8 * 128 * 2,  # 327,680
    "mistral-7b": 2 * 32 * 8 * 128 * 2,  # 131,072
    "deepseek-v3": 61 * (512 + 64) * 2,  # 70,272
    "llama-70b-mha": 2 * 80 * 64 * 128 * 2,  # 2,621,440
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_bytes_per_token_matches_hand_arithmetic(name):
    assert PRESETS[name].kv_bytes_per_token(FP16) == HAND[name]


def test_issue_anchor_values():
    assert PRESETS["llama-3.1-70b"].kv_bytes_per_token(FP16) == 327_680
    assert PRESETS["deepseek-v3"].kv_bytes_per_token(FP16) == 70_272
    # The design documents: 128K tokens of the 70B MHA example = 343.6 GB.
    assert PRESETS["llama-70b-mha"].kv_bytes(131072, FP16) == 343_597_383_680


@pytest.mark.parametrize(
    "name,params,tol",
    [
        ("llama-3.1-8b", 8_030_261_248, 0),  # exact, from the safetensors index
        ("llama-3.1-70b", 70_553_706_496, 0),
        ("llama-3.1-405b", 405_853_388_800, 0),
        ("mistral-7b", 7_241_732_096, 0),
        ("qwen2.5-7b", 7.61e9, 0.01),  # model card: 7.61B
        ("qwen2.5-72b", 72.7e9, 0.01),  # model card: 72.7B
        ("deepseek-v3", 671e9, 0.005),  # paper: 671B total (MTP excluded)
    ],
)
def test_parameter_counts(name, params, tol):
    got = PRESETS[name].num_params
    assert abs(got - params) <= tol * params


def test_moe_active_params_deepseek():
    # DeepSeek-V3 paper: 37B activated per token.
    assert abs(PRESETS["deepseek-v3"].num_active_params - 37e9) / 37e9 < 0.03


def test_attention_designs():
    assert PRESETS["llama-70b-mha"].attention is Attention.MHA
    assert PRESETS["llama-3.1-8b"].attention is Attention.GQA
    assert PRESETS["deepseek-v3"].attention is Attention.MLA
    cfg = {"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 1}
    assert from_hf_config(cfg, name="t", source="t").attention is Attention.MQA


def test_sliding_window_caps_kv():
    m = PRESETS["mistral-7b"]
    per_tok = m.kv_bytes_per_token(FP16)
    assert m.kv_bytes(1000, FP16) == 1000 * per_tok
    assert m.kv_bytes(32768, FP16) == 4096 * per_tok  # every layer windowed at 4096


def test_cross_layer_sharing_halves_kv():
    cfg = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8}
    m = from_hf_config(cfg, name="t", source="t")
    from dataclasses import replace

    shared = replace(m, kv_layer_group=2)
    assert shared.kv_bytes_per_token(FP16) * 2 == m.kv_bytes_per_token(FP16)


def test_quantized_bytes_include_metadata():
    m = PRESETS["llama-3.1-8b"]
    int4 = make_format("int4", group_size=64)[0]
    # per vector: 128/2 packed bytes + 2 groups x (fp16 scale + fp16 zero) = 64 + 8 = 72
    assert m.kv_bytes_per_token(int4) == 2 * 32 * 8 * 72
    kvq = make_format("kvquant4", outlier_fraction=0.01)[0]
    # 64 packed + 2 scale + ceil(1.28)=2 outliers x (2 value + 2 index) = 74
    assert m.kv_bytes_per_token(kvq) == 2 * 32 * 8 * 74
    fp8 = make_format("fp8")[0]
    assert m.kv_bytes_per_token(fp8) == 2 * 32 * 8 * 128
    assert m.kv_static_bytes(fp8) == 32 * 2 * 4  # one fp32 scale per layer for K and V


def test_hf_config_roundtrip_llama(tmp_path):
    cfg = {
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "torch_dtype": "bfloat16",
    }
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    m = load_model(str(p))
    assert m.kv_bytes_per_token(FP16) == 131072
    assert m.num_params == 8_030_261_248


def test_hf_config_deepseek_mla(tmp_path):
    cfg = {
        "num_hidden_layers": 61,
        "hidden_size": 7168,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "q_lora_rank": 1536,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "n_shared_experts": 1,
        "moe_intermediate_size": 2048,
        "first_k_dense_replace": 3,
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
        "intermediate_size": 18432,
        "vocab_size": 129280,
        "max_position_embeddings": 163840,
    }
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    m = load_model(str(p))
    assert m.attention is Attention.MLA
    assert m.kv_bytes_per_token(FP16) == 70_272
    assert m.num_params == PRESETS["deepseek-v3"].num_params
    assert m.weight_dtype == "fp8" == PRESETS["deepseek-v3"].weight_dtype  # released in FP8


@pytest.mark.parametrize(
    "content,message",
    [
        ("{not json", "malformed JSON"),
        ('{"hidden_size": 4096}', "num_hidden_layers"),
        (
            '{"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 3}',
            "num_key_value_heads",
        ),
        ('{"num_hidden_layers": -2, "hidden_size": 64, "num_attention_heads": 4}', "num_hidden_layers"),
    ],
)
def test_bad_hf_configs(tmp_path, content, message):
    p = tmp_path / "config.json"
    p.write_text(content)
    with pytest.raises(KvsimError, match=message) as ei:
        load_model(str(p))
    assert "config.json" in str(ei.value)


def test_unknown_model_suggests_close_matches():
    with pytest.raises(KvsimError, match="did you mean llama-3.1-70b"):
        load_model("llama-3.1-7b")
