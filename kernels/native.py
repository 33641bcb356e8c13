"""The CPU engine's native kernels (kernels/csrc/cpu_decode.c: int8- and int4-weight GEMVs for decode rows,
decode attention over the paged KV pool, and a Llama decode forward of every layer in one call): built with
the machine's C compiler on first use,
loaded with ctypes, and optional: `available()` is False (and callers use torch's kernels) without a compiler,
without AVX2 + FMA, or with SGNB_NATIVE=0.

The shared library is cached under $SGNB_CACHE_DIR (default ~/.cache/sgnb) by a hash of the source, the flags
and the compiler's version, written atomically so that concurrent processes (tests, tensor-parallel workers)
can build it at once. The GEMVs and attention run on threads of the library's own (cpu_decode.c says why:
OpenMP put its workers to sleep between the ~150 parallel regions of a step); the module path's elementwise
kernels use OpenMP, and bind to the libgomp torch already loaded (the library is loaded after torch).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger("sgnb.kernels")

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_decode.c"
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-pthread", "-fPIC", "-shared", "-std=c11"]
BLOCK = 32  # the kernels' quantization block along K
MAX_ROWS = 128  # rows of x per GEMV call (the kernel keeps one accumulator per row)
MAX_GROUP = 16  # query heads per KV head the decode attention takes

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_why_not: str | None = None
_off = False  # set_enabled(False): benchmarks compare against torch's kernels in one process


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (read once), or None where it cannot be read."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return None


def _cpu_ok() -> bool:
    flags = cpu_flags()
    if flags is None:
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    return "avx2" in flags and "fma" in flags and "f16c" in flags


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _compile(cc: str, cache: Path, out: Path) -> None:
    """cpu_decode.c into `out`, atomically (a temporary file renamed into place)."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        res = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=300)
        if res.returncode:
            raise RuntimeError(f"{cc} failed: {res.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build() -> ctypes.CDLL:
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + version.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("SGNB_CACHE_DIR") or Path.home() / ".cache" / "sgnb") / "native"
    out = cache / f"cpu_decode-{key}.so"
    if not out.exists():
        from sgnb.folder_lock import folder_lock

        with folder_lock(cache):  # processes starting together compile once (~9 s), not each
            if not out.exists():
                _compile(cc, cache, out)
    lib = ctypes.CDLL(str(out))
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.sgnb_q8_gemv.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i32]
    lib.sgnb_q4_gemv.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i32]
    lib.sgnb_f32_gemv.argtypes = [ptr, ptr, ptr, i64, i64, i64, i32]
    lib.sgnb_qf32_gemv.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i32]
    lib.sgnb_quantize_rows.argtypes = [ptr, ptr, ptr, i64, i64]
    lib.sgnb_paged_decode.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64,
                                      ctypes.c_float, ptr, ptr, i32]
    lib.sgnb_decode_layers.argtypes = [ptr, i64, i64, ptr, ptr, ctypes.c_float, ptr, ptr, ptr, ptr, ptr, i64, ptr,
                                       ptr, i64, i64, i64, i64, i64, ctypes.c_float, i32]
    lib.sgnb_set_isa.argtypes = [i32]
    lib.sgnb_rms_norm.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, ctypes.c_float, i32]
    lib.sgnb_rope.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, ptr, ptr, ptr, i64, i32]
    lib.sgnb_silu_mul.argtypes = [ptr, i64, ptr, i64, i64, i32]
    for f in (lib.sgnb_decode_layers, lib.sgnb_q8_gemv, lib.sgnb_q4_gemv, lib.sgnb_f32_gemv, lib.sgnb_qf32_gemv,
              lib.sgnb_quantize_rows, lib.sgnb_paged_decode, lib.sgnb_set_isa, lib.sgnb_rms_norm, lib.sgnb_rope,
              lib.sgnb_silu_mul):
        f.restype = i32
    return lib


ISAS = ("avx2", "avx512-vnni")  # the several-row GEMVs' kernels, in sgnb_set_isa's order
_isa = ISAS[0]


def _apply_isa(lib: ctypes.CDLL, name: str) -> str:
    global _isa
    if name != "auto" and name not in ISAS:
        raise ValueError(f"unknown kernel set {name!r} (SGNB_NATIVE_ISA): expected auto or one of {ISAS}")
    _isa = ISAS[lib.sgnb_set_isa(len(ISAS) - 1 if name == "auto" else ISAS.index(name))]
    return _isa


def set_isa(name: str) -> str:
    """Use the several-row GEMV kernels of `name` (ISAS; "auto": the best the CPU has) from now on, in every
    engine of this process; returns the one taken (avx2 where the CPU lacks what was asked). The default is
    $SGNB_NATIVE_ISA, else auto."""
    return _apply_isa(_need(), name)


def isa() -> str:
    """The several-row GEMVs' kernels in use (ISAS)."""
    _need()
    return _isa


def set_enabled(on: bool) -> None:
    """Turn the kernels off (or back on) for engines built from now on (benchmarks' side-by-side runs)."""
    global _off
    _off = not on


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (why: `unavailable_reason()`). Builds them on the first call."""
    global _lib, _tried, _why_not
    if _off:
        return None
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        if os.environ.get("SGNB_NATIVE", "1") == "0":
            _why_not = "SGNB_NATIVE=0"
        elif not _cpu_ok():
            _why_not = "the CPU lacks AVX2 + FMA + F16C"
        else:
            try:
                _lib = _build()
            except Exception as e:  # no compiler, a failed build, a sandbox without /tmp: torch's kernels instead
                _why_not = f"build failed: {e}"
            else:
                _apply_isa(_lib, os.environ.get("SGNB_NATIVE_ISA", "auto"))
        if _why_not:
            log.info("native CPU kernels unavailable (%s): quantized linears use torch's kernels", _why_not)
        _tried = True
        return _lib


def available() -> bool:
    return library() is not None


def unavailable_reason() -> str | None:
    library()
    return "turned off (set_enabled)" if _off else _why_not


def _need() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError(f"native CPU kernels unavailable: {_why_not}")
    return lib


def _check_x(x: torch.Tensor, K: int) -> None:
    assert x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous(), (
        x.device, x.dtype, x.shape)
    assert x.shape[1] == K and K % BLOCK == 0 and 0 < x.shape[0] <= MAX_ROWS, (x.shape, K)


def q8_gemv(x: torch.Tensor, wq: torch.Tensor, wd: torch.Tensor) -> torch.Tensor:
    """x (M, K) float32 contiguous; wq (N, K) int8, wd (N, K / 32) float32 (see quantize_q8) -> (M, N) float32."""
    N, K = wq.shape
    _check_x(x, K)
    assert wq.dtype == torch.int8 and wd.shape == (N, K // BLOCK) and wd.dtype == torch.float32
    y = torch.empty(x.shape[0], N)
    rc = _need().sgnb_q8_gemv(wq.data_ptr(), wd.data_ptr(), x.data_ptr(), y.data_ptr(), x.shape[0], K, N,
                           torch.get_num_threads())
    if rc:
        raise RuntimeError(f"sgnb_q8_gemv failed ({rc})")
    return y


def q4_gemv(x: torch.Tensor, wq: torch.Tensor, wd: torch.Tensor, wm: torch.Tensor) -> torch.Tensor:
    """x (M, K) float32 contiguous; wq (N, K / 2) uint8, wd and wm (N, K / 32) float16 (see pack_q4) -> (M, N)."""
    N = wq.shape[0]
    K = wq.shape[1] * 2
    _check_x(x, K)
    assert wq.dtype == torch.uint8 and wd.dtype == wm.dtype == torch.float16, (wq.dtype, wd.dtype, wm.dtype)
    assert wd.shape == wm.shape == (N, K // BLOCK) and wq.is_contiguous() and wd.is_contiguous() and wm.is_contiguous()
    y = torch.empty(x.shape[0], N)
    rc = _need().sgnb_q4_gemv(wq.data_ptr(), wd.data_ptr(), wm.data_ptr(), x.data_ptr(), y.data_ptr(), x.shape[0],
                              K, N, torch.get_num_threads())
    if rc:
        raise RuntimeError(f"sgnb_q4_gemv failed ({rc})")
    return y


def f32_gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (M, K) float32 contiguous; w (N, K) float32 contiguous (an nn.Linear's weight) -> x @ w.T (M, N), each
    row's result independent of the other rows (cpu_decode.c)."""
    N, K = w.shape
    assert x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous(), (
        x.device, x.dtype, x.shape)
    assert w.dtype == torch.float32 and w.is_contiguous() and x.shape[1] == K and K % 8 == 0, (w.dtype, w.shape)
    y = torch.empty(x.shape[0], N)
    rc = _need().sgnb_f32_gemv(w.data_ptr(), x.data_ptr(), y.data_ptr(), x.shape[0], K, N, torch.get_num_threads())
    if rc:
        raise RuntimeError(f"sgnb_f32_gemv failed ({rc})")
    return y


def qf32_gemv(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x (M, K) float32 contiguous; a weight (N, K) held as int8 codes q (N, K) with float32 d, m (N, K / 32):
    w = q * d + m per block of 32, rebuilt by one fma per weight -> x @ w.T (M, N), float32 products, each row's
    result independent of the other rows (cpu_decode.c). Where that fma gives the float32 weight itself (see
    kernels/dense_linear.py exact_codes), this is f32_gemv over that weight reading a quarter of its bytes."""
    N, K = q.shape
    assert x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous(), (
        x.device, x.dtype, x.shape)
    assert q.dtype == torch.int8 and q.is_contiguous() and x.shape[1] == K and K % BLOCK == 0, (q.dtype, q.shape)
    for t in (d, m):
        assert t.dtype == torch.float32 and t.is_contiguous() and t.shape == (N, K // BLOCK), (t.dtype, t.shape)
    y = torch.empty(x.shape[0], N)
    rc = _need().sgnb_qf32_gemv(q.data_ptr(), d.data_ptr(), m.data_ptr(), x.data_ptr(), y.data_ptr(), x.shape[0], K,
                                N, torch.get_num_threads())
    if rc:
        raise RuntimeError(f"sgnb_qf32_gemv failed ({rc})")
    return y


def pack_q4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit codes q (N, K) in [0, 15] with w = q * d + m per block of 32 (d, m (N, K / 32)) -> the kernel's
    form: (N, K / 2) uint8 and d, m in float16. A block's 16 bytes hold codes j (low nibble) and j + 16 (high);
    the columns go in tiles of four, pair of blocks by pair of blocks (cpu_decode.c says why); the last N % 4
    columns one after another."""
    N, K = q.shape
    qb = q.to(torch.uint8).view(N, K // BLOCK, 2, BLOCK // 2)
    packed = (qb[:, :, 0] | (qb[:, :, 1] << 4)).reshape(N, K // 2)
    return _to_tiles(packed), d.to(torch.float16).contiguous(), m.to(torch.float16).contiguous()


def _to_tiles(cols: torch.Tensor) -> torch.Tensor:
    """(N, B) bytes, column after column -> the tiled order (same shape): per tile of four columns their pairs
    of blocks (32 bytes each) interleaved, then each column's odd last block (16 bytes)."""
    N, B = cols.shape
    P, T = B // 32, N // 4
    tiles = cols[: 4 * T].reshape(T, 4, B)
    pairs = tiles[:, :, : 32 * P].reshape(T, 4, P, 32).transpose(1, 2).reshape(T, 128 * P)
    rest = tiles[:, :, 32 * P:].reshape(T, -1)
    return torch.cat([torch.cat([pairs, rest], 1).reshape(4 * T, B), cols[4 * T:]]).contiguous()


def _from_tiles(packed: torch.Tensor) -> torch.Tensor:
    """_to_tiles undone: (N, B) bytes column after column."""
    N, B = packed.shape
    P, T = B // 32, N // 4
    tiles = packed[: 4 * T].reshape(T, 4 * B)
    pairs = tiles[:, : 128 * P].reshape(T, P, 4, 32).transpose(1, 2).reshape(T, 4, 32 * P)
    rest = tiles[:, 128 * P:].reshape(T, 4, B - 32 * P)
    return torch.cat([torch.cat([pairs, rest], 2).reshape(4 * T, B), packed[4 * T:]])


def q4_codes(packed: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes (N, K) that pack_q4's bytes hold."""
    cols = _from_tiles(packed)
    N, K = cols.shape[0], cols.shape[1] * 2
    pb = cols.reshape(N, K // BLOCK, BLOCK // 2)
    return torch.stack([pb & 0x0F, pb >> 4], dim=2).reshape(N, K)


def unpack_q4(packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The float32 weight (N, K) that pack_q4's output stands for."""
    q = q4_codes(packed).float()
    N, K = q.shape
    return (q.view(N, K // BLOCK, BLOCK) * d.float()[..., None] + m.float()[..., None]).view(N, K)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' rounding of x (M, K): int8 (M, K) and scales (M, K / 32), x ~ xq * scale per block."""
    M, K = x.shape
    x = x.float().contiguous()
    xq, dx = torch.empty(M, K, dtype=torch.int8), torch.empty(M, K // BLOCK)
    rc = _need().sgnb_quantize_rows(x.data_ptr(), xq.data_ptr(), dx.data_ptr(), M, K)
    if rc:
        raise RuntimeError(f"sgnb_quantize_rows failed ({rc})")
    return xq, dx


def quantize_q8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per block of 32 along K (Q8_0's rule, d = max |w| / 127): (N, K) -> int8 (N, K) and
    float32 scales (N, K / 32); lossless for a weight that came from a Q8_0 GGUF tensor."""
    N, K = w.shape
    wg = w.float().view(N, K // BLOCK, BLOCK)
    d = wg.abs().amax(-1) / 127.0  # (N, G)
    q = torch.round(wg / d.clamp(min=1e-30)[..., None]).clamp(-127, 127).to(torch.int8)
    return q.view(N, K), d


def dequantize_q8(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The float32 weight (N, K) that quantize_q8's (q, d) stand for."""
    N, K = q.shape
    return (q.float().view(N, K // BLOCK, BLOCK) * d[..., None]).view(N, K)


LAYER_FIELDS = 21  # the int64 fields of one layer's row in decode_layers' table (cpu_decode.c: LF_*)


def linear_fields(layer: torch.nn.Module) -> list[int] | None:
    """A QuantLinear's or F32Linear's 4 fields in a decode_layers table (kind, then its weight tensors'
    addresses), or None when it does not run on our kernels."""
    from sgnb.kernels.dense_linear import F32Linear

    if isinstance(layer, F32Linear):
        if layer.codes is not None:
            return [33, *(t.data_ptr() for t in layer.codes)]
        return [32, layer.weight.data_ptr(), 0, 0]
    run = getattr(layer, "_native", None)
    if run is None:
        return None
    if run[0] is q4_gemv:
        return [4, *(t.data_ptr() for t in run[1])]
    if run[0] is q8_gemv:
        return [8, run[1][0].data_ptr(), run[1][1].data_ptr(), 0]
    return None


def decode_layers(table: torch.Tensor, x: torch.Tensor, final_norm: torch.Tensor, eps: float,
                  positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_loc: torch.Tensor,
                  req_to_token: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, heads: int, kv_heads: int,
                  head_dim: int, intermediate: int, scale: float) -> torch.Tensor:
    """A whole forward of a Llama-family model over B <= MAX_ROWS new tokens (see cpu_decode.c): a decode's one
    token per request, or the tokens of short extends, x (B, hidden) float32 embeddings; table (L, LAYER_FIELDS)
    int64 (the caller keeps every tensor it points to alive); positions, out_loc (the tokens' KV slots), rows
    (their req_to_token rows) and lens (keys each attends to, its own included: an extend's row j over a
    prefix p reads p + j + 1) (B,) int64; cos / sin (P, D / 2) float32. Writes each layer's K / V at out_loc
    and returns the final hidden states (B, hidden), in x's storage."""
    B, hidden = x.shape
    assert x.dtype == torch.float32 and x.is_contiguous() and 0 < B <= MAX_ROWS, (x.dtype, x.shape)
    assert table.dtype == torch.int64 and table.is_contiguous() and table.shape[1] == LAYER_FIELDS, table.shape
    for t in (positions, out_loc, rows, lens):
        assert t.dtype == torch.int64 and t.is_contiguous() and t.shape == (B,), (t.dtype, t.shape)
    assert cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
    assert cos.shape[1] * 2 == head_dim and req_to_token.dtype == torch.int64 and req_to_token.stride(1) == 1
    rc = _need().sgnb_decode_layers(table.data_ptr(), table.shape[0], B, x.data_ptr(), final_norm.data_ptr(), eps,
                                    positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), out_loc.data_ptr(),
                                    req_to_token.data_ptr(), req_to_token.stride(0), rows.data_ptr(),
                                    lens.data_ptr(), hidden, heads, kv_heads, head_dim, intermediate, scale,
                                    torch.get_num_threads())
    if rc:
        raise RuntimeError(f"sgnb_decode_layers failed ({rc})")
    return x


def paged_decode(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
                 rows: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query per request, q (B, H, D) float32, over the keys at slots
    req_to_token[rows[b], starts[b]: starts[b] + lens[b]] of k_buf / v_buf (S, Hkv, D) float32, read in place.
    rows, starts, lens (B,) int64. Returns out (B, H, D) normalized and lse (B, H) (-inf, zeros: no keys)."""
    B, H, D = q.shape
    Hkv = k_buf.shape[1]
    assert q.dtype == k_buf.dtype == v_buf.dtype == torch.float32 and q.is_contiguous(), (q.dtype, k_buf.dtype)
    assert k_buf.is_contiguous() and v_buf.is_contiguous() and k_buf.shape == v_buf.shape and k_buf.shape[2] == D
    assert H % Hkv == 0 and H // Hkv <= MAX_GROUP and D % 8 == 0, (H, Hkv, D)
    assert req_to_token.dtype == torch.int64 and req_to_token.stride(1) == 1, req_to_token.stride()
    assert rows.dtype == starts.dtype == lens.dtype == torch.int64, (rows.dtype, starts.dtype, lens.dtype)
    assert rows.shape == starts.shape == lens.shape == (B,), (rows.shape, starts.shape, lens.shape)
    rows, starts, lens = rows.contiguous(), starts.contiguous(), lens.contiguous()
    out, lse = torch.empty(B, H, D), torch.empty(B, H)
    rc = _need().sgnb_paged_decode(q.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), req_to_token.data_ptr(),
                                   req_to_token.stride(0), rows.data_ptr(), starts.data_ptr(), lens.data_ptr(),
                                   B, H, Hkv, D, scale, out.data_ptr(), lse.data_ptr(), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"sgnb_paged_decode failed ({rc})")
    return out, lse


# ---- the module path's elementwise steps on the CPU (float32), one pass each -------------------------------
def takes(*tensors: torch.Tensor) -> bool:
    """Whether the elementwise kernels below run these tensors: float32 on the CPU, last dim contiguous, and
    the kernels built."""
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() >= 1 and t.stride(-1) == 1
                for t in tensors) and available())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """kernels/norm.py's rms_norm (residual None) or fused_add_rms_norm (residual += x in place, then its
    norm) on (T, N) rows; returns a new (T, N) tensor."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    T, N = rows.shape
    res = None if residual is None else (residual.view(-1, N) if residual.dim() != 2 else residual)
    assert weight.shape == (N,) and weight.is_contiguous() and (res is None or res.shape == (T, N))
    y = torch.empty(T, N)
    _need().sgnb_rms_norm(rows.data_ptr(), rows.stride(0), None if res is None else res.data_ptr(),
                          0 if res is None else res.stride(0), weight.data_ptr(), y.data_ptr(), N, T, N, eps,
                          torch.get_num_threads())
    return y.view(x.shape)


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q (T, H, D) and k (T, Hkv, D) in place (rotate-half) at positions (T,) of cos / sin (P, D / 2)."""
    T, H, D = q.shape
    assert q.stride(2) == 1 and q.stride(1) == D and k.stride(2) == 1 and k.stride(1) == D, (q.stride(), k.stride())
    assert cos.is_contiguous() and sin.is_contiguous() and cos.shape[1] * 2 == D
    pos = positions.to(torch.int64).contiguous()
    _need().sgnb_rope(q.data_ptr(), q.stride(0), H, k.data_ptr(), k.stride(0), k.shape[1], D, pos.data_ptr(),
                      cos.data_ptr(), sin.data_ptr(), T, torch.get_num_threads())


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x (T, 2I) = [gate | up] -> a new (T, I) silu(gate) * up."""
    T, I2 = x.shape
    y = torch.empty(T, I2 // 2)
    _need().sgnb_silu_mul(x.data_ptr(), x.stride(0), y.data_ptr(), T, I2 // 2, torch.get_num_threads())
    return y
