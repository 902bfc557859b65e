"""Independent references for the fp8kv tests.

- FP8 formats built from their definitions (sign, exponent bias, mantissa bits, special codes): a
  decode table of all 256 codes and a saturating round-to-nearest-even encoder. Neither uses fp8kv
  nor torch's float8 casts.
- A float64 paged-attention reference with the error bound a correct kernel must meet, and the
  bound quantization adds (for end-to-end tests against the unquantized K/V).
- Builders of paged caches (layouts, poisoned unused slots) and attention inputs, shared by the
  CPU and CUDA tests.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import torch

import fp8kv  # noqa: F401  (loads torch.ops.fp8kv)

FLOAT32_UNIT_ROUNDOFF = 2.0**-24

# The CUDA multi-token kernel the tests' calls force through a plan (plan_paged_attention's
# `kernel`): "auto" leaves the choice to the planner and the calls plan themselves. Fixtures set it
# with monkeypatch.setattr(reference, "FORCED_KERNEL", name).
FORCED_KERNEL = "auto"


def forced_plan(query: torch.Tensor, key_cache: torch.Tensor, block_tables: torch.Tensor,
                cu_seqlens_q: torch.Tensor | None, sliding_window: int = -1, fp8_math: bool = False,
                lse: bool = False) -> dict:
    """The `plan` and `workspace` arguments of a multi-token call under FORCED_KERNEL; none for
    "auto" and for decode calls (which run the decode kernel)."""
    if FORCED_KERNEL == "auto" or cu_seqlens_q is None:
        return {}
    values = torch.ops.fp8kv.plan_paged_attention(key_cache, block_tables, cu_seqlens_q, query.shape[0],
                                                  query.shape[1], sliding_window, fp8_math, lse, FORCED_KERNEL)
    return {"plan": values, "workspace": torch.empty(values[0], dtype=torch.uint8, device=query.device)}


# ----------------------------------------------------------------------------------------------
# FP8 formats
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fp8Format:
    name: str
    dtype: torch.dtype
    exponent_bits: int
    mantissa_bits: int
    exponent_bias: int
    # Special codes. "fn": only S.1111.111 is NaN, no infinities. "ieee": exponent all ones is
    # +-inf (mantissa 0) or NaN. "fnuz": 0x80 is the only NaN, no infinities, no negative zero.
    specials: str
    nan_code: int  # the code the encoder writes for NaN (the contract's canonical NaN)

    def decode(self, code: int) -> float:
        sign = -1.0 if code & 0x80 else 1.0
        exponent = (code >> self.mantissa_bits) & ((1 << self.exponent_bits) - 1)
        mantissa = code & ((1 << self.mantissa_bits) - 1)
        exponent_all_ones = exponent == (1 << self.exponent_bits) - 1
        if self.specials == "fnuz" and code == 0x80:
            return math.nan
        if self.specials == "fn" and exponent_all_ones and mantissa == (1 << self.mantissa_bits) - 1:
            return math.nan
        if self.specials == "ieee" and exponent_all_ones:
            return sign * math.inf if mantissa == 0 else math.nan
        if exponent == 0:  # subnormal: no implicit leading one, exponent of the lowest binade
            return sign * mantissa * 2.0 ** (1 - self.exponent_bias - self.mantissa_bits)
        return sign * (1 + mantissa / 2**self.mantissa_bits) * 2.0 ** (exponent - self.exponent_bias)

    @functools.cached_property
    def table(self) -> torch.Tensor:
        """float64 [256]: the value of every code."""
        return torch.tensor([self.decode(code) for code in range(256)], dtype=torch.float64)

    @functools.cached_property
    def _positive_codes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The finite codes with the sign bit clear, in increasing order of value, and their values."""
        codes = torch.tensor([c for c in range(128) if math.isfinite(self.decode(c))])
        values = self.table[codes]
        assert bool((values[1:] > values[:-1]).all()), "codes of a format increase with their value"
        return codes, values

    @property
    def max_finite(self) -> float:
        return float(self._positive_codes[1][-1])

    @property
    def relative_step(self) -> float:
        """Spacing of adjacent normal values relative to the binade's start: 2^-mantissa_bits."""
        return 2.0**-self.mantissa_bits

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (1 - self.exponent_bias - self.mantissa_bits)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 codes of x (any float dtype; the value is taken exactly): saturating, round to
        nearest, ties to the even code, NaN to nan_code, the sign of zero kept except in fnuz."""
        x = x.double().cpu()
        codes, values = self._positive_codes
        magnitude = x.abs().clamp(max=self.max_finite)  # saturation: overflow and inf clamp to max
        upper = torch.searchsorted(values, magnitude).clamp(max=len(values) - 1)
        lower = (upper - 1).clamp(min=0)
        # The midpoint of two adjacent FP8 values is exact in float64, so these comparisons are exact.
        midpoint = (values[lower] + values[upper]) / 2
        upper_is_even = codes[upper] % 2 == 0  # the code's last bit is the mantissa's last bit
        take_upper = (magnitude > midpoint) | ((magnitude == midpoint) & upper_is_even)
        code = torch.where(take_upper, codes[upper], codes[lower])
        negative = torch.signbit(x)
        if self.specials == "fnuz":
            negative &= code != 0  # no negative zero
        code = torch.where(negative, code | 0x80, code)
        code = torch.where(torch.isnan(x), self.nan_code, code)
        return code.to(torch.uint8)

    def midpoints(self) -> torch.Tensor:
        """float64: every midpoint between adjacent finite values, both signs."""
        values = self._positive_codes[1]
        positive = (values[1:] + values[:-1]) / 2
        return torch.cat([positive, -positive])


FORMATS = [
    Fp8Format("e4m3fn", torch.float8_e4m3fn, 4, 3, 7, "fn", 0x7F),
    Fp8Format("e5m2", torch.float8_e5m2, 5, 2, 15, "ieee", 0x7F),
    Fp8Format("e4m3fnuz", torch.float8_e4m3fnuz, 4, 3, 8, "fnuz", 0x80),
]
FORMAT_BY_DTYPE = {f.dtype: f for f in FORMATS}
FORMAT_BY_NAME = {f.name: f for f in FORMATS}

# Cache formats as test parameters: an FP8 format's name, or "none" (unquantized: the cache has the
# dtype of the data written into it).
CACHE_FORMATS = ["e4m3fn", "e5m2", "e4m3fnuz", "none"]


def cache_dtype(cache_format: str, data_dtype: torch.dtype) -> torch.dtype:
    return data_dtype if cache_format == "none" else FORMAT_BY_NAME[cache_format].dtype


def all_16bit_values(dtype: torch.dtype) -> torch.Tensor:
    """Every one of the 65536 bit patterns of float16 or bfloat16, as that dtype."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor (any strides), as an integer tensor of the same element size."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def fill_nan(cache: torch.Tensor) -> None:
    """Poisons a cache (view) with its format's NaN code, or NaN for an unquantized cache."""
    fmt = FORMAT_BY_DTYPE.get(cache.dtype)
    if fmt is None:
        cache.fill_(math.nan)
    else:
        cache.view(torch.uint8).fill_(fmt.nan_code)


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """The contract's stored code of x [..., num_kv_heads, head_size] with dequantization scale
    [1] or [num_kv_heads]: encode(x / s) with the division in float32."""
    quotient = x.float().cpu() / scale.float().cpu().view(-1, 1)
    return fmt.encode(quotient)


# ----------------------------------------------------------------------------------------------
# Caches
# ----------------------------------------------------------------------------------------------

# NHD: allocated [num_blocks, block_size, H, D]. HND: allocated [num_blocks, H, block_size, D] and
# passed permuted. interleaved: K and V halves of one [num_blocks, 2, block_size, H, D] buffer.
CACHE_LAYOUTS = ["NHD", "HND", "interleaved"]


def allocate_caches(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                    dtype: torch.dtype, layout: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value caches, logical shape [num_blocks, block_size, num_kv_heads, head_size]."""
    if layout == "NHD":
        shape = (num_blocks, block_size, num_kv_heads, head_size)
        return (torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
    if layout == "HND":
        shape = (num_blocks, num_kv_heads, block_size, head_size)
        return tuple(torch.empty(shape, dtype=dtype, device=device).permute(0, 2, 1, 3) for _ in range(2))
    if layout == "interleaved":
        storage = torch.empty(num_blocks, 2, block_size, num_kv_heads, head_size, dtype=dtype, device=device)
        return storage[:, 0], storage[:, 1]
    raise ValueError(layout)


def cache_values(cache: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 values of a cache (any layout, same device): FP8 codes decoded with the test's table
    and multiplied by the dequantization scale; an unquantized cache as is (scales do not apply)."""
    fmt = FORMAT_BY_DTYPE.get(cache.dtype)
    if fmt is None:
        return cache.double()
    table = fmt.table.to(cache.device)
    return table[cache.view(torch.uint8).long()] * scale.double().to(cache.device).view(1, 1, -1, 1)


# ----------------------------------------------------------------------------------------------
# Attention reference and its error bound
# ----------------------------------------------------------------------------------------------


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` values at magnitude |x| (float64; subnormal spacing below the normals)."""
    info = torch.finfo(dtype)
    _, exponent = torch.frexp(x.abs().clamp(min=info.tiny))  # |x| = m * 2^e, m in [0.5, 1)
    return info.eps * torch.pow(2.0, (exponent - 1).double())


@dataclass
class AttentionReference:
    out: torch.Tensor    # float64 [num_query_tokens, num_heads, head_size]
    bound: torch.Tensor  # float64, same shape: the largest |kernel - out| a correct kernel may have


@dataclass
class _SequenceAttention:
    """One sequence's attention in float64, over the positions some of its query rows see."""
    rows: slice             # its query rows
    q: torch.Tensor         # [t, H, D]
    k: torch.Tensor         # [n, H, D], KV heads repeated for their query heads
    v: torch.Tensor         # [n, H, D]
    slots: tuple            # (blocks, offsets) of the n positions, to gather other per-slot data
    visible: torch.Tensor   # bool [t, n]
    weights: torch.Tensor   # [H, t, n] softmax weights (0 where not visible)
    logits: torch.Tensor    # [H, t, n] before the soft cap
    out: torch.Tensor       # [t, H, D]


def _attend_sequences(query, key_values, value_values, block_tables, seq_lens, cu_seqlens_q, softmax_scale,
                      sliding_window, logits_soft_cap):
    device = key_values.device
    block_size = key_values.shape[1]
    group = query.shape[1] // key_values.shape[2]
    lens = seq_lens.tolist()
    cu = cu_seqlens_q.tolist() if cu_seqlens_q is not None else list(range(len(lens) + 1))
    tables = block_tables.to(device).long()
    for seq, seq_len in enumerate(lens):
        q_begin, q_len = cu[seq], cu[seq + 1] - cu[seq]
        if q_len == 0 or seq_len == 0:
            continue
        first, _ = visible_range(seq_len, q_len, sliding_window)
        positions = torch.arange(first, seq_len, device=device)
        slots = (tables[seq, positions // block_size], positions % block_size)
        k = key_values[slots].repeat_interleave(group, dim=1)
        v = value_values[slots].repeat_interleave(group, dim=1)
        q = query[q_begin:q_begin + q_len].to(device).double()
        logits = softmax_scale * torch.einsum("thd,nhd->htn", q, k)
        capped = logits_soft_cap * torch.tanh(logits / logits_soft_cap) if logits_soft_cap > 0 else logits
        query_position = torch.arange(seq_len - q_len, seq_len, device=device).view(q_len, 1)
        visible = positions.view(1, -1) <= query_position
        if sliding_window > 0:
            visible &= positions.view(1, -1) > query_position - sliding_window
        weights = torch.softmax(capped.masked_fill(~visible, -math.inf), dim=-1)
        out = torch.einsum("htn,nhd->thd", weights, v)
        yield _SequenceAttention(slice(q_begin, q_begin + q_len), q, k, v, slots, visible, weights, logits, out)


def paged_attention_reference(query: torch.Tensor, key_values: torch.Tensor, value_values: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor,
                              cu_seqlens_q: torch.Tensor | None, softmax_scale: float,
                              sliding_window: int = -1, logits_soft_cap: float = 0.0,
                              product_dtype: torch.dtype | None = None) -> AttentionReference:
    """Attention in float64 over float64 caches (scales already applied, e.g. by cache_values),
    and the bound on a correct kernel's error before the output's rounding.

    The kernel computes in fp32 (unit roundoff u = 2^-24) from the same dequantized values, so
    quantization does not enter. A tensor-core kernel (FlashAttention-style, like fp8kv's CUDA
    kernel: docs/cuda_decode_design.md) may also convert q to the 16-bit `product_dtype` of its
    matrix products and round the probabilities P to it before P.V; eta is that type's unit
    roundoff (2^-11 for fp16, 2^-9 for bf16; 0 for product_dtype None: no such rounding).
    Per output row, with D = head_size, n = number of visible keys, c = soft cap,
    S = max over visible keys j of softmax_scale * sum_i |q_i k_ij|:
    - each logit is off by at most (D + 2) u S (dot product in any summation order, the product
      with the folded scale), plus Q = max_j softmax_scale * sum_i |dq_i| |k_ij| where dq is q's
      conversion error (0 unless a bf16 q lies in fp16's subnormal range); the soft cap adds
      4 u c (tanh, division, product); subtracting the running max and exp add (2 S + 2) u
      relative to the weight (also covers exp2 with a folded log2(e), approximate exp2, __expf);
      online-softmax rescaling adds 3 u per key tile or split (<= n); rounding P adds eta. So
      every unnormalized weight is p_j * exp(theta_j) with
      |theta_j| <= delta = ((D + 16) S + 4 c + 3 n + 16) u + Q + eta;
    - normalizing, each weight w_j is off by at most expm1(2 delta) w_j;
    - except that a P in product_dtype's subnormal range is off by up to half its spacing h
      (2^-25 for fp16) absolutely: with p_j relative to the row's max (sum_j p_j = 1 / max_j w_j;
      a running max only makes the kernel's P larger), numerator and denominator add at most
      h * max_j w_j * (sum over subnormal j of |v_j| + their count * |ref|);
    - the sums sum_j p_j v_j and sum_j p_j (any order, with rescaling), the final division and the
      products with v_scale add (4 n + 16) u relative to M = sum_j w_j |v_j| (per element).
    So |kernel before rounding - ref| <= (expm1(2 delta) + (4 n + 16) u) * M + the subnormal
    term, to first order in u (second-order terms are ~2^-40). add_output_rounding adds the final
    rounding to fp16/bf16.
    """
    u = FLOAT32_UNIT_ROUNDOFF
    eta = torch.finfo(product_dtype).eps / 2 if product_dtype is not None else 0.0
    head_size = query.shape[2]
    out = torch.zeros(query.shape, dtype=torch.float64, device=key_values.device)
    error = torch.zeros_like(out)
    for a in _attend_sequences(query, key_values, value_values, block_tables, seq_lens, cu_seqlens_q,
                               softmax_scale, sliding_window, logits_soft_cap):
        out[a.rows] = a.out
        k_abs, v_abs = a.k.abs(), a.v.abs()
        magnitude = softmax_scale * torch.einsum("thd,nhd->htn", a.q.abs(), k_abs)
        s_max = magnitude.masked_fill(~a.visible, 0).amax(-1)                          # [H, t]
        n = a.visible.sum(-1).double()                                                 # [t]
        delta = ((head_size + 16) * s_max + 4 * logits_soft_cap + 3 * n + 16) * u + eta
        if product_dtype is not None:
            delta = delta + _query_conversion_error(a, product_dtype, softmax_scale, k_abs)
        relative = torch.expm1(2 * delta) + (4 * n + 16) * u                          # [H, t]
        error[a.rows] = relative.t().unsqueeze(-1) * torch.einsum("htn,nhd->thd", a.weights, v_abs)
        if product_dtype is not None:
            error[a.rows] += _subnormal_probability_error(a, product_dtype, v_abs)
    return AttentionReference(out, error)


def _query_conversion_error(a: _SequenceAttention, product_dtype, softmax_scale, k_abs) -> torch.Tensor:
    """[H, t]: max over visible keys of the logit error from converting q to product_dtype."""
    q_conversion = (a.q - a.q.to(product_dtype).double()).abs()
    assert bool(q_conversion.isfinite().all()), "query outside the product dtype's range"
    q_error = softmax_scale * torch.einsum("thd,nhd->htn", q_conversion, k_abs)
    return q_error.masked_fill(~a.visible, 0).amax(-1)


def _subnormal_probability_error(a: _SequenceAttention, product_dtype, v_abs) -> torch.Tensor:
    """[t, H, D]: error from probabilities below product_dtype's normal range."""
    info = torch.finfo(product_dtype)
    max_weight = a.weights.amax(-1, keepdim=True)                                      # [H, t, 1]
    subnormal = ((a.weights < max_weight * info.tiny) & a.visible).double()           # p_j subnormal
    count = subnormal.sum(-1).t().unsqueeze(-1)                                        # [t, H, 1]
    spill = torch.einsum("htn,nhd->thd", subnormal, v_abs) + count * a.out.abs()
    return info.eps / 2 * info.tiny * max_weight.squeeze(-1).t().unsqueeze(-1) * spill


def kernel_product_dtype(cache: torch.Tensor) -> torch.dtype | None:
    """The 16-bit type the kernel for `cache`'s device may round q and P to for its matrix
    products: none for the CPU kernel (fp32 throughout); for the CUDA kernel the tensor-core type,
    fp16 (FP8 and fp16 values are exact in it), or bf16 for a bf16 cache."""
    if cache.device.type == "cpu":
        return None
    return torch.bfloat16 if cache.dtype == torch.bfloat16 else torch.float16


def add_output_rounding(reference: AttentionReference, out_dtype: torch.dtype) -> AttentionReference:
    """Adds the final rounding to out_dtype: half an ulp of the pre-rounding value. A decode row
    with seq_len 0 has ref 0 and bound ulp(0) / 2, so only an exact 0 passes."""
    bound = reference.bound + ulp(reference.out.abs() + reference.bound, out_dtype) / 2
    return AttentionReference(reference.out, bound)


def quantization_spacing(x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """float64 spacing of the FP8 grid (times the scale) around x [..., num_kv_heads, D]: the
    binade's 2^-mantissa_bits relative step for normal values, the subnormal step below."""
    scale = scale.double().to(x.device).view(-1, 1)
    a = (x.double() / scale).abs()
    _, exponent = torch.frexp(a.clamp(min=2.0 ** (1 - fmt.exponent_bias)))  # floor(log2 a) = e - 1
    return torch.pow(2.0, (exponent - 1 - fmt.mantissa_bits).double()) * scale


def quantization_error_bound(query, key_values, value_values, key_error, value_error, block_tables, seq_lens,
                             cu_seqlens_q, softmax_scale, sliding_window=-1, logits_soft_cap=0.0,
                             sigmas: float = 6.0) -> torch.Tensor:
    """Bound on |attention(quantized K/V) - attention(K/V)| per output element (float64).

    key_error, value_error: caches of per-element bounds b on the quantization error (half the
    grid spacing). Each stored element's error e is bounded by b and, for data not aligned with
    the FP8 grid, zero-mean and independent of the others. To first order the output error is a
    sum of independent terms:
      out_d' - out_d = sum_ij w_j g_j (v_jd - out_d) softmax_scale q_i ek_ij + sum_j w_j ev_jd
    (g_j = 1 - tanh^2 is the soft cap's slope), so by Hoeffding's inequality it exceeds
    sigmas * sqrt(sum of (coefficient * b)^2) with probability below 2 exp(-sigmas^2 / 2) (3e-8
    for 6). That is ~sqrt(3) * sigmas standard deviations of the actual (near uniform) errors,
    which leaves ample room for the second-order terms, smaller by a factor of the logit error
    (~2^-4 here).
    """
    bound = torch.zeros(query.shape, dtype=torch.float64, device=key_values.device)
    group = query.shape[1] // key_values.shape[2]
    for a in _attend_sequences(query, key_values, value_values, block_tables, seq_lens, cu_seqlens_q,
                               softmax_scale, sliding_window, logits_soft_cap):
        bk = key_error[a.slots].repeat_interleave(group, dim=1)
        bv = value_error[a.slots].repeat_interleave(group, dim=1)
        slope = 1 - torch.tanh(a.logits / logits_soft_cap) ** 2 if logits_soft_cap > 0 else 1.0
        logit_variance = softmax_scale**2 * torch.einsum("thd,nhd->htn", a.q**2, bk**2)  # per unit e
        kw = (a.weights * slope) ** 2 * logit_variance                                     # [H, t, n]
        # sum_j kw_j (v_jd - out_d)^2, expanded so the sum over j is one contraction
        key_part = (torch.einsum("htn,nhd->thd", kw, a.v**2) - 2 * a.out * torch.einsum("htn,nhd->thd", kw, a.v)
                    + a.out**2 * kw.sum(-1).t().unsqueeze(-1))
        value_part = torch.einsum("htn,nhd->thd", a.weights**2, bv**2)
        bound[a.rows] = sigmas * (key_part.clamp(min=0) + value_part).sqrt()
    return bound


# The FP8 math of the CUDA sm_90a kernel (`fp8_math`; csrc/cuda/tiles.h, namespace fp8_math).
E4M3_MAX = 448.0
FP8_PROBABILITY_SHIFT = 8  # P is quantized as 2^(logit - running max + 8)
FP8_PROMOTE_KEYS = 128     # P V of this many keys accumulates in the FP8 MMAs' accumulator, then in fp32
# The FP8 MMAs add into their accumulator keeping about 13 mantissa bits (truncating); this bound takes
# 2^-12 per k-step of 32 products.
FP8_ACCUMULATOR_UNIT = 2.0**-12


def fp8_math_error_bound(query, key_values, value_values, block_tables, seq_lens, cu_seqlens_q, softmax_scale,
                         sliding_window=-1, logits_soft_cap=0.0, sigmas: float = 6.0) -> torch.Tensor:
    """Bound per output element (float64, before the output's rounding) on what the FP8 math adds to
    the fp32 arithmetic that paged_attention_reference bounds, in the basis `query` and the caches are
    given in (the rotated recipe's rotated basis: a caller maps the bound back).

    Three parts, each to first order:
    - the query: each row is scaled by 448 / max|q| and rounded to e4m3 (error e_i, |e_i| <= b_i, half
      the e4m3 spacing there times the row's scale; zero-mean and independent for data off the grid).
      The output moves by sum_i e_i c_i with c_i = softmax_scale sum_j w_j g_j (v_jd - out_d) k_ij (g:
      the soft cap's slope): Hoeffding bounds it by sigmas * sqrt(sum_i (b_i c_i)^2);
    - P: p_j = 2^(logit_j - m + 8), m the running max (at most the row's max), rounded to e4m3 and
      then scaled by 2^(m - max) exactly: in units of the row's sum each error is at most
      max(2^-4 w_j, 2^-18 max_j w_j) (normal values: half a spacing, 2^-4 relative; subnormal or
      flushed: half the smallest subnormal, 2^-10 against the largest p of 2^8), zero-mean and
      independent: Hoeffding over j, times |v_jd|;
    - the FP8 MMAs' accumulators: a logit sums D / 32 k-steps (relative error at most (D / 32)
      FP8_ACCUMULATOR_UNIT of softmax_scale sum_i |q_i k_ij|, which moves a weight by a factor within
      exp(+-2 delta)); P V sums FP8_PROMOTE_KEYS / 32 k-steps before each fp32 addition
      ((FP8_PROMOTE_KEYS / 32) FP8_ACCUMULATOR_UNIT of sum_j w_j |v_jd|). Without the two-level
      accumulation a long row's error would grow with its number of k-steps and break this bound.
    """
    fmt = FORMAT_BY_NAME["e4m3fn"]
    head_size = query.shape[2]
    bound = torch.zeros(query.shape, dtype=torch.float64, device=key_values.device)
    for a in _attend_sequences(query, key_values, value_values, block_tables, seq_lens, cu_seqlens_q,
                               softmax_scale, sliding_window, logits_soft_cap):
        row_scale = (a.q.abs().amax(-1, keepdim=True) / E4M3_MAX).clamp(min=1e-300)        # [t, H, 1]
        scaled = (a.q / row_scale).abs()
        _, exponent = torch.frexp(scaled.clamp(min=2.0 ** (1 - fmt.exponent_bias)))
        q_error = torch.pow(2.0, (exponent - 2 - fmt.mantissa_bits).double()) * row_scale  # half spacing
        slope = 1 - torch.tanh(a.logits / logits_soft_cap) ** 2 if logits_soft_cap > 0 else 1.0
        wg = a.weights * slope                                                              # [H, t, n]
        # c[t, h, d, i] = softmax_scale * sum_j wg_j (v_jd - out_d) k_ji, per head, rows in chunks
        q_term = torch.empty_like(a.out)
        rows = max(1, (1 << 27) // (head_size * a.k.shape[0]))
        for h in range(query.shape[1]):
            for t in range(0, a.q.shape[0], rows):
                w = wg[h, t:t + rows]                                                        # [r, n]
                vk = (w.unsqueeze(1) * a.v[:, h].t().unsqueeze(0)) @ a.k[:, h]               # [r, D, D]
                c = softmax_scale * (vk - a.out[t:t + rows, h].unsqueeze(-1) * (w @ a.k[:, h]).unsqueeze(1))
                q_term[t:t + rows, h] = sigmas * ((c * q_error[t:t + rows, h].unsqueeze(1)) ** 2).sum(-1).sqrt()
        w_max = a.weights.amax(-1, keepdim=True)
        # Half the smallest e4m3 subnormal, 2^-10, against the largest p, 2^8.
        smallest = 2.0 ** -(fmt.exponent_bias + fmt.mantissa_bits + FP8_PROBABILITY_SHIFT)
        p_error = torch.maximum(a.weights * 2.0 ** -(fmt.mantissa_bits + 1), w_max * smallest)
        p_error = p_error.masked_fill(~a.visible, 0)
        p_term = sigmas * torch.einsum("htn,nhd->thd", p_error**2, a.v**2).sqrt()
        magnitude = softmax_scale * torch.einsum("thd,nhd->htn", a.q.abs(), a.k.abs())
        s_max = magnitude.masked_fill(~a.visible, 0).amax(-1)                                # [H, t]
        delta = head_size / 32 * FP8_ACCUMULATOR_UNIT * s_max
        relative = torch.expm1(2 * delta).t().unsqueeze(-1) + FP8_PROMOTE_KEYS / 32 * FP8_ACCUMULATOR_UNIT
        acc_term = relative * torch.einsum("htn,nhd->thd", a.weights, a.v.abs())
        bound[a.rows] = q_term + p_term + acc_term
    return bound


def assert_within(out: torch.Tensor, reference: AttentionReference, what: str = "") -> None:
    """|out - reference.out| <= reference.bound everywhere (NaN fails), with the worst offenders shown."""
    actual = out.double().to(reference.out.device)
    excess = (actual - reference.out).abs() - reference.bound
    ok = excess <= 0  # NaN compares False
    if bool(ok.all()):
        return
    bad = (~ok).nonzero()
    worst = bad[excess[~ok].nan_to_num(math.inf).argsort(descending=True)[:5]]
    lines = [f"{what}: {len(bad)} of {out.numel()} elements outside the bound"]
    for index in worst.tolist():
        i = tuple(index)
        lines.append(f"  [{', '.join(map(str, i))}] got {actual[i].item():.8g} want "
                     f"{reference.out[i].item():.8g} bound {reference.bound[i].item():.3g}")
    raise AssertionError("\n".join(lines))


# ----------------------------------------------------------------------------------------------
# Paged attention inputs
# ----------------------------------------------------------------------------------------------


@dataclass
class PagedAttentionInputs:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor | None
    softmax_scale: float
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    sliding_window: int = -1
    logits_soft_cap: float = 0.0
    out: torch.Tensor | None = None  # preallocated output (maybe strided); None: like query
    fp8_math: bool = False

    def run(self) -> torch.Tensor:
        """Calls the op on an `out` poisoned with NaN, so every element must be written."""
        out = torch.empty_like(self.query) if self.out is None else self.out
        out.fill_(math.nan)
        torch.ops.fp8kv.paged_attention(out, self.query, self.key_cache, self.value_cache, self.block_tables,
                                  self.seq_lens, self.cu_seqlens_q, self.softmax_scale, self.k_scale,
                                  self.v_scale, self.sliding_window, self.logits_soft_cap, fp8_math=self.fp8_math,
                                  **self.forced_plan())
        return out

    def forced_plan(self, lse: bool = False) -> dict:
        return forced_plan(self.query, self.key_cache, self.block_tables, self.cu_seqlens_q, self.sliding_window,
                           self.fp8_math, lse)

    def reference(self) -> AttentionReference:
        """The float64 attention and a correct kernel's bound: its fp32 arithmetic, its 16-bit operands
        or, with fp8_math, what the FP8 math adds."""
        keys, values = cache_values(self.key_cache, self.k_scale), cache_values(self.value_cache, self.v_scale)
        args = (self.query, keys, values, self.block_tables, self.seq_lens, self.cu_seqlens_q, self.softmax_scale,
                self.sliding_window, self.logits_soft_cap)
        reference = paged_attention_reference(*args, None if self.fp8_math else kernel_product_dtype(self.key_cache))
        if self.fp8_math:
            reference = AttentionReference(reference.out, reference.bound + fp8_math_error_bound(*args))
        return add_output_rounding(reference, self.query.dtype)


def visible_range(seq_len: int, q_len: int, sliding_window: int) -> tuple[int, int]:
    """Cache positions [first, seq_len) that some query row of a sequence may see."""
    first = max(0, seq_len - q_len - sliding_window + 1) if sliding_window > 0 else 0
    return first, seq_len


def paged_block_tables(seq_lens: list[int], q_lens: list[int], block_size: int, sliding_window: int,
                       generator: torch.Generator, spare_blocks: int = 2):
    """Shuffled block tables and the slots each sequence's visible positions occupy.

    Returns (block_tables int32 [num_seqs, max_blocks], num_blocks, poison_block, slots) where
    slots[s] is an int64 tensor of the slots of positions visible_range(...) of sequence s. Blocks
    are assigned in a random order (non-contiguous, shuffled); a table entry that no query reads
    (past seq_len, or a block wholly before the sliding window) names `poison_block`, a real block
    that holds only NaN codes, so a kernel that reads it fails.
    """
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(blocks_per_seq + [1]) + 1
    poison_block = 0
    num_blocks = sum(blocks_per_seq) + spare_blocks + 1
    order = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()  # 0 is the poison block
    tables = torch.full((len(seq_lens), max_blocks), poison_block, dtype=torch.int32)
    slots = []
    for s, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens)):
        first, last = visible_range(seq_len, q_len, sliding_window)
        for b in range(blocks_per_seq[s]):
            block = order.pop()
            if (b + 1) * block_size > first:  # blocks wholly before the window stay poisoned
                tables[s, b] = block
        positions = torch.arange(first, last)
        slots.append(tables[s, positions // block_size].long() * block_size + positions % block_size)
    return tables, num_blocks, poison_block, slots


def random_kv(num_tokens: int, num_kv_heads: int, head_size: int, generator: torch.Generator) -> torch.Tensor:
    """float32 [num_tokens, num_kv_heads, head_size], unit normal with a different magnitude per
    head (so per-head scales differ) and a few outlier channels (as real K has)."""
    x = torch.randn(num_tokens, num_kv_heads, head_size, generator=generator)
    head_magnitude = torch.linspace(0.5, 2.0, num_kv_heads).view(1, -1, 1)
    channel_magnitude = torch.ones(head_size)
    channel_magnitude[torch.randperm(head_size, generator=generator)[:2]] = 4.0
    return x * head_magnitude * channel_magnitude


def calibrated_scales(x: torch.Tensor, cache_format: str, per_head: bool,
                      generator: torch.Generator) -> torch.Tensor:
    """float32 dequantization scales amax / max_finite, [1] or [num_kv_heads]. For an unquantized
    cache (or no data), arbitrary values far from 1, which the ops must ignore."""
    num_kv_heads = x.shape[1]
    if cache_format == "none" or x.numel() == 0:
        return 0.25 + 3 * torch.rand(num_kv_heads if per_head else 1, generator=generator)
    amax = x.abs().amax(dim=(0, 2)) if per_head else x.abs().amax().view(1)
    return (amax / FORMAT_BY_NAME[cache_format].max_finite).float()


def stored(x: torch.Tensor, scale: torch.Tensor, cache_format: str, data_dtype: torch.dtype) -> torch.Tensor:
    """What a cache slot holds for x: FP8 codes (uint8), or x in data_dtype's bits."""
    if cache_format == "none":
        return bits(x.to(data_dtype))
    return quantize(x, scale, FORMAT_BY_NAME[cache_format])


def make_paged_attention_inputs(*, seq_lens: list[int], q_lens: list[int] | None, num_heads: int,
                                num_kv_heads: int, head_size: int, block_size: int, cache_format: str,
                                query_dtype: torch.dtype, per_head_scales: bool, layout: str = "NHD",
                                sliding_window: int = -1, logits_soft_cap: float = 0.0,
                                strided: bool = False, query_magnitude: float = 1.0, seed: int = 0,
                                device="cpu") -> PagedAttentionInputs:
    """A paged-attention problem: caches filled with quantized random K/V at every slot some query
    may see, and the format's NaN everywhere else (past seq_len, unused and out-of-window blocks).

    q_lens None: decode (one query row per sequence; a sequence may have seq_len 0 = padding).
    strided: query is a slice of a fused QKV tensor, out a slice with padded heads, and the block
    table a column slice of a wider table.
    """
    generator = torch.Generator().manual_seed(seed)
    decode = q_lens is None
    q_lens_or_one = [1] * len(seq_lens) if decode else q_lens
    tables, num_blocks, _, slots = paged_block_tables(seq_lens, q_lens_or_one, block_size, sliding_window, generator)
    dtype = cache_dtype(cache_format, query_dtype)
    key_cache, value_cache = allocate_caches(num_blocks, block_size, num_kv_heads, head_size, dtype, layout, device)
    fill_nan(key_cache)
    fill_nan(value_cache)
    slots = torch.cat(slots)
    key, value = (random_kv(len(slots), num_kv_heads, head_size, generator) for _ in range(2))
    k_scale = calibrated_scales(key, cache_format, per_head_scales, generator)
    v_scale = calibrated_scales(value, cache_format, per_head_scales, generator)
    blocks, offsets = slots // block_size, slots % block_size
    for cache, x, scale in ((key_cache, key, k_scale), (value_cache, value, v_scale)):
        codes = bits(cache)
        codes[blocks.to(device), offsets.to(device)] = stored(x, scale, cache_format, query_dtype).to(device)

    num_query_tokens = sum(q_lens_or_one)
    fused_heads = num_heads + 2 * num_kv_heads if strided else num_heads
    fused = torch.randn(num_query_tokens, fused_heads, head_size, generator=generator) * query_magnitude
    query = fused.to(query_dtype).to(device)[:, :num_heads]  # strided: the Q part of a fused QKV tensor
    out = None
    if strided:
        out = torch.empty(num_query_tokens, num_heads, head_size + 16, dtype=query_dtype, device=device)
        out = out[:, :, :head_size]
        wide = torch.full((tables.shape[0], tables.shape[1] + 3), -7, dtype=torch.int32)
        wide[:, :tables.shape[1]] = tables
        tables = wide.to(device)[:, :tables.shape[1]]  # .to(device) of the slice would copy it
    cu_seqlens_q = None
    if not decode:
        cu_seqlens_q = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    return PagedAttentionInputs(
        query=query, key_cache=key_cache, value_cache=value_cache, block_tables=tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), cu_seqlens_q=cu_seqlens_q,
        softmax_scale=head_size**-0.5, k_scale=k_scale.to(device), v_scale=v_scale.to(device),
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, out=out)


# ----------------------------------------------------------------------------------------------
# Test grids
# ----------------------------------------------------------------------------------------------


def covering_grid(full: dict[str, list], paired: dict[str, list]) -> list[dict]:
    """Every combination of the `full` axes, each extended with values of the `paired` axes chosen
    greedily so that every pair of values of any two axes occurs in some case."""
    def pairs(case):
        return {((a, case[a]), (b, case[b])) for a, b in itertools.combinations(case, 2)}

    cases = [dict(zip(full, values)) for values in itertools.product(*full.values())]
    covered = set().union(*map(pairs, cases))
    for name, values in paired.items():
        for i, case in enumerate(cases):
            rotated = values[i % len(values):] + values[:i % len(values)]  # spreads ties
            case[name] = max(rotated, key=lambda value: len(pairs({**case, name: value}) - covered))
            covered |= pairs(case)
    axes = {**full, **paired}
    wanted = {((a, x), (b, y)) for a, b in itertools.combinations(axes, 2) for x in axes[a] for y in axes[b]}
    assert wanted <= covered, f"grid misses pairs {sorted(wanted - covered)[:5]}"
    return cases
