"""Quantized weights in the runtime: fp8 blocks (DeepSeek-V3 / Kimi-K2) and compressed-tensors int8 / int4.

weight.py holds a linear's weight quantized (QuantizedWeight); load.py decides which linears hold them and
loads their stored tensors (scales, zero points) by the WeightLayout; the kernel and its twin are in
kernels/quant_linear.py (the fused CPU kernel in kernels/csrc/quant_gemm.h).
"""
