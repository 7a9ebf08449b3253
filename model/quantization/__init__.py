"""Weight quantization: int8 per channel, int4 per group, and quantization-aware training.

kernels.py     the math: quantize, dequantize, int4 packing, fake quantization for QAT
checkpoint.py  the quantized.npz file: written, read, checked
export.py      a trained run -> a quantized run directory (scripts/quantize.py)
"""
