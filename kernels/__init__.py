"""sgnb.kernels: compute kernels, each beside a pure-torch reference (the CPU path and the test oracle).

Kernels are leaves: they import torch (and triton on CUDA), nothing of sgnb.
"""
