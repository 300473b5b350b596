"""Break-even arithmetic: every figure in docs/ARCHITECTURE.md "The numbers", reproduced exactly."""
from __future__ import annotations

import pytest

from kvtier import breakeven, presets
from kvtier.breakeven import evaluate

H100 = presets.gpu_preset("h100").dense_tflops
L70 = presets.model_preset("llama-3-70b")


def test_70b_gqa_fp16_kv_is_327680_bytes_per_token():
    assert breakeven.kv_bytes_per_token(80, 8, 128, 2) == 327_680 == 320 * 1024
    assert evaluate(L70, tflops_per_gpu=H100).kv_bytes_per_token == 327_680


def test_70b_without_gqa_is_2560_kib_per_token():
    r = evaluate(presets.model_preset("llama-2-70b"), tflops_per_gpu=H100)
    assert r.kv_bytes_per_token == 2560 * 1024


def test_a_2000_token_prefix_on_70b_is_625_mib():
    r = evaluate(L70, tflops_per_gpu=H100, prefix_tokens=2000)
    assert r.prefix_bytes == 625 * 2**20


def test_h100_uses_the_dense_figure_not_the_sparsity_one():
    assert H100 == 989.5
    assert presets.gpu_preset("a100").dense_tflops == 312.0


@pytest.mark.parametrize("tp, gbps", [(1, 2.32), (2, 4.63), (4, 9.26), (8, 18.53)])
def test_70b_fp16_break_even_scales_with_tp(tp, gbps):
    assert round(evaluate(L70, tflops_per_gpu=H100, tp=tp).break_even_gbps, 2) == gbps


def test_fp8_kv_halves_the_break_even():
    r = evaluate(L70, tflops_per_gpu=H100, tp=4, kv_dtype="fp8")
    assert round(r.break_even_gbps, 2) == 4.63
    assert r.kv_bytes_per_token == 163_840


def test_8b_fp16_tp1_break_even_is_8_11():
    r = evaluate(presets.model_preset("llama-3-8b"), tflops_per_gpu=H100)
    assert round(r.break_even_gbps, 2) == 8.11


def test_70b_prefill_at_tp4_is_35_4_us_per_token():
    assert round(evaluate(L70, tflops_per_gpu=H100, tp=4).prefill_us_per_token, 1) == 35.4


def test_prefix_length_cancels_out_of_the_break_even():
    short = evaluate(L70, tflops_per_gpu=H100, tp=4, prefix_tokens=16)
    long = evaluate(L70, tflops_per_gpu=H100, tp=4, prefix_tokens=100_000)
    assert short.break_even_gbps == long.break_even_gbps


@pytest.mark.parametrize(
    "medium, ratio, verdict",
    [("dram", 6.9, "serve"), ("rdma", 2.7, "serve"), ("nvme", 0.8, "refused"), ("object-store", 0.1, "refused")],
)
def test_media_verdicts_at_tp4_for_interactive_traffic(medium, ratio, verdict):
    m = evaluate(L70, tflops_per_gpu=H100, tp=4).medium(medium)
    assert round(m.ratio, 1) == ratio
    assert m.verdict == verdict
    assert m.capacity is None
    if verdict == "refused":
        assert "slower than recompute" in m.reason


def test_batch_traffic_may_serve_nvme_on_the_capacity_rule():
    nvme = evaluate(L70, tflops_per_gpu=H100, tp=4, traffic="batch").medium("nvme")
    assert nvme.ratio < 1 and nvme.verdict == "serve"
    assert nvme.capacity is not None and nvme.capacity.helps
    # A DMA costs ~0 GPU-seconds; recompute costs 2 x params / per-GPU FLOP/s of them.
    assert nvme.capacity.fetch_gpu_s_per_token == 0.0
    assert nvme.capacity.gpu_s_saved_per_token == pytest.approx(2 * 70e9 / (H100 * 1e12))


def test_concurrency_divides_a_shared_medium():
    nvme = evaluate(L70, tflops_per_gpu=H100, tp=4, concurrency=8).medium("nvme")
    assert round(nvme.effective_gbps, 1) == 0.9
    assert nvme.ratio == pytest.approx(0.875 / 9.2656, rel=1e-3)


def test_moe_recomputes_with_active_params_and_mla_overrides_kv_bytes():
    r = evaluate(presets.model_preset("deepseek-v3"), tflops_per_gpu=H100)
    assert r.recompute_params == 37e9
    assert r.kv_bytes_per_token == (512 + 64) * 61 * 2
    expected = r.kv_bytes_per_token * H100 * 1e12 / (2 * 37e9) / 1e9
    assert r.break_even_gbps == pytest.approx(expected)


def test_custom_media_and_kv_bytes_override():
    r = evaluate(L70, tflops_per_gpu=H100, tp=4, media={"cxl": 32.0}, kv_bytes_override=163_840)
    assert [m.name for m in r.media] == ["cxl"]
    assert round(r.break_even_gbps, 2) == 4.63


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"tp": 0}, "tp"),
        ({"tflops_per_gpu": -1.0}, "tflops_per_gpu"),
        ({"concurrency": 0}, "concurrency"),
        ({"kv_dtype": "int3"}, "kv_dtype"),
        ({"traffic": "bulk"}, "traffic"),
        ({"media": {"disk": 0.0}}, "medium disk gbps"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs, name):
    base = {"tflops_per_gpu": H100}
    with pytest.raises(ValueError, match=name):
        evaluate(L70, **{**base, **kwargs})


def test_unknown_presets_list_the_choices():
    with pytest.raises(ValueError, match="llama-3-70b"):
        presets.model_preset("gpt-5")
    with pytest.raises(ValueError, match="h100"):
        presets.gpu_preset("tpu")
    assert presets.model_preset("Llama_3_70B") is L70
