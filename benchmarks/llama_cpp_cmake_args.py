"""CMAKE_ARGS for building llama-cpp-python (the benchmarks' llama.cpp peer) for this machine's CPU: every
SIMD extension it has, as GGML_NATIVE would pick, except AMX. On the AMX Xeons we are lent, a native build
(AMX_INT8 = 1) crashed in its first decode (SIGSEGV, 2026-12-02): the guest cannot use the tiles it reports."""

from pathlib import Path

# /proc/cpuinfo flag -> ggml's CMake option (GGML_NATIVE=OFF takes these one by one)
OPTIONS = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C", "bmi2": "GGML_BMI2",
           "avx_vnni": "GGML_AVX_VNNI", "avx512f": "GGML_AVX512", "avx512vbmi": "GGML_AVX512_VBMI",
           "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16"}


def cmake_args() -> str:
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return ""  # not Linux: llama.cpp's own native detection
    on = [f"-D{opt}={'ON' if flag in flags else 'OFF'}" for flag, opt in OPTIONS.items()]
    return " ".join(["-DGGML_NATIVE=OFF", *on])


if __name__ == "__main__":
    print(cmake_args())
