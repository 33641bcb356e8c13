"""FP8 (e4m3) weight linears: FP8 checkpoints and `quantization="fp8"` (a bf16 checkpoint quantized at load).

A weight is held as e4m3 values `q` (N, K) and float32 scales (N, G) with w ~ q * scale: G = 1 is one scale
per output channel (a per-tensor scale is stored this way too, repeated), G = cdiv(K, 128) is 128-column groups
per row (a checkpoint's 128x128 block scales, each block's scale repeated over its 128 rows). One form covers
every checkpoint scheme, and fused q/k/v or gate/up weights are their parts' rows stacked, scales included.

On CUDA, at a decode step's one or two rows a layer with per-channel scales runs the small-M Triton kernel: a
weight stream along K reduced in registers, no tensor-core tile. Above that it runs our tiled Triton kernel
(wide layers, up to `Fp8Linear.triton_max_m` rows) or `torch._scaled_mm` (cuBLASLt FP8 GEMM) on
the activations quantized per token at run time (dynamic per-token scales, rowwise scaling of both operands).
Grouped scales always run the tiled kernel. Both Triton kernels multiply the activations in their own dtype by
the e4m3 weights converted in registers, applying each group's scale to its partial sum: they read 1 byte per
weight, like _scaled_mm, with no activation rounding. Elsewhere (CPU: the tests' engine) `fp8_linear_ref`:
dequantize, then matmul.
"""

from __future__ import annotations

import torch
from torch import nn

from sgnb.kernels._triton_utils import cdiv, jit, next_pow2, tl, triton, use_triton

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
GROUP = 128  # K columns per scale in the grouped form (the 128x128 block checkpoints' block side)


# ---- quantizing ---------------------------------------------------------------------------------------------
def quantize_fp8(w: torch.Tensor, scheme: str = "channel") -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) -> e4m3 q (N, K) and float32 scales with w ~ q * scale: "tensor" (), "channel" (N,) or "block"
    (cdiv(N, 128), cdiv(K, 128)): the checkpoint forms (see `scales_to_rows` for the one the layers hold)."""
    wf = w.float()
    N, K = wf.shape
    if scheme == "tensor":
        scale = (wf.abs().amax() / FP8_MAX).clamp(min=1e-12)  # ()
        return (wf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
    if scheme == "channel":
        scale = (wf.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)  # (N,)
        return (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
    assert scheme == "block", scheme
    nb, kb = cdiv(N, GROUP), cdiv(K, GROUP)
    padded = torch.zeros(nb * GROUP, kb * GROUP, dtype=torch.float32, device=w.device)
    padded[:N, :K] = wf
    blocks = padded.view(nb, GROUP, kb, GROUP)  # (nb, 128, kb, 128)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)  # (nb, kb)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(nb * GROUP, kb * GROUP)[:N, :K]
    return q.to(FP8).contiguous(), scale


def scales_to_rows(scale: torch.Tensor, shape: tuple[int, int], block: bool) -> torch.Tensor:
    """A checkpoint's scale (per-tensor (), (1,); per-channel (N,), (N, 1); 128x128 blocks (cdiv(N, 128),
    cdiv(K, 128)) when `block`) -> the layers' form (N, 1) or (N, cdiv(K, 128)), float32."""
    N, K = shape
    s = scale.float()
    if block:
        assert s.shape == (cdiv(N, GROUP), cdiv(K, GROUP)), (s.shape, shape)
        return s.repeat_interleave(GROUP, dim=0)[:N].contiguous()  # (N, G)
    if s.numel() == 1:
        return s.reshape(1, 1).expand(N, 1).contiguous()
    assert s.numel() == N, (s.shape, shape)
    return s.reshape(N, 1).contiguous()


def dequantize_fp8(q: torch.Tensor, scale_rows: torch.Tensor) -> torch.Tensor:
    """The float32 weight (N, K) that q (N, K) e4m3 and its row scales (N, 1) or (N, G) stand for."""
    N, K = q.shape
    G = scale_rows.shape[1]
    if G == 1:
        return q.float() * scale_rows
    return q.float() * scale_rows.repeat_interleave(GROUP, dim=1)[:, :K]


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation scales: x (M, K) -> e4m3 (M, K) and float32 (M, 1), one scale per row (token)."""
    scale = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)  # (M, 1)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


@jit
def _quantize_per_token_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK_K: tl.constexpr):
    # one row: its absolute max (pass 1), then the row scaled into e4m3's range (pass 2)
    m = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + m * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, 0) / 448.0, 1e-12)
    tl.store(s_ptr + m, scale)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + m * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
        tl.store(q_ptr + m * stride_qm + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=k0 + offs < K)


def _quantize_per_token_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_per_token in one launch."""
    M, K = x.shape
    assert x.stride(1) == 1, x.stride()
    q = torch.empty(M, K, dtype=FP8, device=x.device)
    scale = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    if M:
        _quantize_per_token_kernel[(M,)](x, q, scale, K, x.stride(0), q.stride(0), BLOCK_K=1024)
    return q, scale


def fp8_linear_ref(x: torch.Tensor, q: torch.Tensor, scale_rows: torch.Tensor, quantize_input: bool = False
                   ) -> torch.Tensor:
    """x (M, K) @ dequantized weight^T in float32, out in x's dtype. quantize_input: x first rounded to e4m3
    per token, what the _scaled_mm path computes (the GPU checks compare it with this)."""
    xf = x.float()
    if quantize_input:
        xq, xs = quantize_per_token(x)
        xf = xq.float() * xs
    return (xf @ dequantize_fp8(q, scale_rows).t()).to(x.dtype)


# ---- the Triton kernel --------------------------------------------------------------------------------------
@jit
def _fp8_linear_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                       GROUPED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # y[m, n] = sum_k x[m, k] * q[n, k] * s[n, k // BLOCK_K]   (BLOCK_K == GROUP, so one scale per step)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm  # (BM, 1)
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn  # (1, BN)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # (BM, BK)
        w = tl.load(w_cols + (k0 + offs_k)[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # (BK, BN)
        part = tl.dot(x, w.to(x.dtype))
        if GROUPED:
            s = tl.load(s_ptr + offs_n * stride_sn + k0 // BLOCK_K, mask=n_ok, other=0.0)  # (BN,)
            acc += part * s[None, :]
        else:
            acc += part
    if not GROUPED:
        acc *= tl.load(s_ptr + offs_n * stride_sn, mask=n_ok, other=0.0)[None, :]
    y = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _fp8_linear_triton(x: torch.Tensor, q: torch.Tensor, scale_rows: torch.Tensor) -> torch.Tensor:
    assert triton is not None
    M, K = x.shape
    N = q.shape[0]
    assert q.shape == (N, K) and q.dtype == FP8 and q.stride(1) == 1 and x.stride(1) == 1, (q.shape, x.shape)
    G = scale_rows.shape[1]
    assert scale_rows.shape == (N, G) and G in (1, cdiv(K, GROUP)) and scale_rows.dtype == torch.float32
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64
    # enough column tiles to keep every SM of an H200 (132) streaming weights with two programs each; a
    # small-M call is a weight read, its time set by how many programs stream at once
    block_n = next((b for b in (64, 32) if cdiv(N, b) * cdiv(M, block_m) >= 264), 16)
    grid = (cdiv(M, block_m), cdiv(N, block_n))
    _fp8_linear_kernel[grid](x, q, scale_rows, y, M, N, K, x.stride(0), q.stride(0), scale_rows.stride(0),
                             y.stride(0), GROUPED=G > 1, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=GROUP)
    return y


# ---- the small-M (decode) kernel -----------------------------------------------------------------------------
@jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, K_PER_SPLIT,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT_K: tl.constexpr, LATE_SUM: tl.constexpr):
    # y[m, n] = s[n] * sum_k x[m, k] * q[n, k] for M <= BLOCK_M (a decode step's row or two), per-channel scales.
    # A program streams BLOCK_N weight rows along K, where they are contiguous (16-byte loads of 16 e4m3 values),
    # and reduces x * w over K in float32 registers: a weight read with no tensor-core tile to fill, which at one
    # row is what the time is. LATE_SUM keeps a (BM, BN, BK) accumulator and reduces over BLOCK_K once at the end
    # (no cross-thread reduction per step); SPLIT_K > 1 gives each program K_PER_SPLIT columns of K (program axis
    # 1) and adds its partial sums into a float32 y that starts at zero.
    pid_n = tl.program_id(0)
    k_begin = tl.program_id(1) * K_PER_SPLIT
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn  # (BN, 1)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm  # (BM, 1)
    k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
    if LATE_SUM:
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < k_end
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc3 += x[:, None, :] * w[None, :, :]
        acc = tl.sum(acc3, axis=2)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < k_end
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # (BN, BK)
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # (BM, BK)
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)  # (BM, BN)
    acc *= tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    y = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    if SPLIT_K > 1:
        tl.atomic_add(y, acc, mask=m_ok[:, None] & n_ok[None, :])
    else:
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# (BLOCK_N, BLOCK_K, num_warps, num_stages) by BLOCK_M, from `bench_moe_fp8.py --parts gemv` on an H100
# (2026-12-06, benchmarks/results/2026-12-06-gpu-fp8-gemv.json: the tile with the least geometric-mean time over
# the decode linears of Llama-2-7B and Qwen3-8B, weights read from HBM). At 4 rows this kernel is the slowest FP8
# path on every shape (1.3-2.7x the best other), hence GEMV_MAX_M = 2; Fp8Linear says where it runs below that.
# A config may add (SPLIT_K, LATE_SUM) (_fp8_gemv_kernel). The sweep of session 22 (H100,
# 2026-12-06-gpu-s22-gemv.json) put the late sum first at one row: 12-13% less time on the narrow layers (Llama o
# 0.0112 -> 0.0099 ms, down 0.0276 -> 0.0241), the same on the wide ones; split-K won nowhere at one row.
GEMV_CONFIGS: dict[int, tuple[int, ...]] = {1: (8, 1024, 4, 4, 1, 1), 2: (8, 1024, 4, 4)}
GEMV_MAX_M = max(GEMV_CONFIGS)  # rows up to which Fp8Linear's per-channel layers take the small-M kernel on CUDA


def _fp8_gemv_triton(x: torch.Tensor, q: torch.Tensor, scale_rows: torch.Tensor,
                     config: tuple[int, ...] | None = None) -> torch.Tensor:
    """x (M, K) @ (q * scale)^T with per-channel scales (N, 1), for M <= GEMV_MAX_M: the small-M kernel,
    activations in their own dtype. `config` (BLOCK_N, BLOCK_K, num_warps, num_stages[, SPLIT_K, LATE_SUM])
    overrides GEMV_CONFIGS (the tuning benchmark's sweep, at any M)."""
    assert triton is not None
    M, K = x.shape
    N = q.shape[0]
    assert q.shape == (N, K) and q.dtype == FP8 and q.stride(1) == 1 and x.stride(1) == 1, (q.shape, x.shape)
    assert scale_rows.shape == (N, 1) and scale_rows.dtype == torch.float32 and scale_rows.is_contiguous()
    block_m = next_pow2(M)
    assert block_m <= GEMV_MAX_M or config is not None, M
    block_n, block_k, warps, stages, split, late = (*(config or GEMV_CONFIGS[block_m]), 1, 0)[:6]
    split = max(1, min(split, cdiv(K, block_k)))
    k_per_split = cdiv(cdiv(K, split), block_k) * block_k
    split = cdiv(K, k_per_split)
    # split K: the programs add float32 partial sums into a zeroed y, cast to x's dtype after
    y = torch.zeros(M, N, dtype=torch.float32, device=x.device) if split > 1 else \
        torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        _fp8_gemv_kernel[(cdiv(N, block_n), split)](x, q, scale_rows, y, M, N, K, x.stride(0), q.stride(0),
                                                    y.stride(0), k_per_split, BLOCK_M=block_m, BLOCK_N=block_n,
                                                    BLOCK_K=block_k, SPLIT_K=split, LATE_SUM=bool(late),
                                                    num_warps=warps, num_stages=stages)
    return y.to(x.dtype) if split > 1 else y


def _fp8_linear_scaled_mm(x: torch.Tensor, q: torch.Tensor, scale_rows: torch.Tensor) -> torch.Tensor:
    """cuBLASLt FP8 GEMM with rowwise scales: per-token activations (M, 1), per-channel weights (1, N)."""
    xq, xs = _quantize_per_token_triton(x)
    return torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=scale_rows.view(1, -1), out_dtype=x.dtype)


class Fp8Linear(nn.Module):
    """A drop-in for nn.Linear with e4m3 weights `weight` (N, K) and float32 scales `weight_scale` (N, 1) or
    (N, cdiv(K, 128)); an optional bias in the activations' dtype. Input and output keep the caller's dtype."""

    # Which kernel a per-channel layer runs, by rows M (the H100 sweep of 2026-12-06, weights read from HBM):
    # - M <= gemv_max_m: the small-M kernel (at one row 0.57-1.0x the tiled kernel's time and 0.63-0.87x
    #   _scaled_mm's on every decode linear measured). A wide layer (N >= WIDE) takes it at one row only: at two,
    #   the tiled kernel is faster there (0.76-0.81x), the small-M kernel on narrow ones (0.77-0.81x the best other).
    # - a wide layer up to triton_max_m rows: the tiled kernel (0.85x _scaled_mm at 8 rows; on narrow layers one
    #   program per 16-64 columns leaves SMs idle and it loses, 1.11-1.15x).
    # - else _scaled_mm. Grouped scales always run the tiled kernel.
    gemv_max_m = GEMV_MAX_M
    triton_max_m = 16
    WIDE = 8192

    def __init__(self, q: torch.Tensor, scale_rows: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        N, K = q.shape
        assert q.dtype == FP8 and scale_rows.shape[0] == N and scale_rows.dim() == 2, (q.dtype, scale_rows.shape)
        self.in_features, self.out_features = K, N
        self.weight = nn.Parameter(q.contiguous(), requires_grad=False)
        self.weight_scale = nn.Parameter(scale_rows.float().contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        """`linear` quantized with per-output-channel scales (quantization="fp8")."""
        q, scale = quantize_fp8(linear.weight.detach(), "channel")
        return cls(q, scale[:, None], linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # (M, K)
        q, s = self.weight, self.weight_scale
        if use_triton(x2):
            x2 = x2.contiguous()
            m, wide = x2.shape[0], self.out_features >= self.WIDE
            aligned = self.in_features % 16 == 0 and self.out_features % 16 == 0
            if s.shape[1] > 1 or not aligned or (wide and 1 < m <= self.triton_max_m):
                y = _fp8_linear_triton(x2, q, s)
            elif m <= (min(1, self.gemv_max_m) if wide else self.gemv_max_m):
                y = _fp8_gemv_triton(x2, q, s)
            else:
                y = _fp8_linear_scaled_mm(x2, q, s)
        else:
            y = fp8_linear_ref(x2, q, s)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kind = "per-channel" if self.weight_scale.shape[1] == 1 else f"{GROUP}-column groups"
        return f"in={self.in_features}, out={self.out_features}, e4m3 weights, {kind} scales"


def quantize_linears_fp8(module: nn.Module, names: tuple[str, ...], skip: tuple[str, ...] = ("lm_head",)
                         ) -> dict[str, int]:
    """Replace every nn.Linear child named in `names` (not in `skip`: the head keeps its dtype, its logits
    being the most sensitive) by Fp8Linear.from_linear, in place; returns {"fp8": count}."""
    n = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if name in names and name not in skip and isinstance(child, nn.Linear):
                setattr(parent, name, Fp8Linear.from_linear(child))
                n += 1
    return {"fp8": n}
