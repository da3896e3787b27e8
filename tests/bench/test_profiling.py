"""bench/profiling.py's kernel classes: the breakdown W1 and L1 print to say where the time goes."""

from __future__ import annotations

import pytest

from bench.profiling import categorize


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "attention"),
        ("_varlen_attention_forward", "attention"),
        # q/k norms and rotary fused into the kernel that feeds attention: counted with attention.
        ("triton_per_fused__flash_attention_forward__to_copy_add_cat_mean_mul_neg_pow_rsqrt", "attention"),
        ("nvjet_sm90_tst_256x128_64x4_2x4_h_bz_coopA_TNT", "matmul"),
        # FP8's SiLU-and-multiply with the next product's input quantization (named after what it feeds).
        ("triton_red_fused__scaled_mm__to_copy_abs_amax_clamp_div_mul_silu_t_view_5", "elementwise/norm"),
        # A fused RMSNorm: its casts read "_to_copy", but it is a norm, not a copy.
        ("triton_red_fused__to_copy__unsafe_view_add_mean_mul_pow_rsqrt_3", "elementwise/norm"),
        ("triton_poi_fused__unsafe_view_mul_silu_4", "elementwise/norm"),
        # The fused MLP's gate/up products with their SiLU; the norm that feeds it is named after it.
        ("_gate_up_silu_kernel", "matmul"),
        ("triton_red_fused__to_copy_add_gate_up_silu_mean_mul_pow_rsqrt_view_3", "elementwise/norm"),
        ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>", "copy/index"),
        ("Memcpy DtoH (Device -> Pinned)", "copy/index"),
        ("void at::native::vectorized_gather_kernel<16, long>", "copy/index"),
        ("some_unknown_kernel", "other"),
    ],
)
def test_kernel_classes(name: str, expected: str) -> None:
    assert categorize(name) == expected
