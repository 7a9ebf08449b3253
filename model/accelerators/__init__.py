"""GPUs and TPUs, checked from a machine that has neither.

devices.py    the accelerators a plan can be made for: peak bf16 FLOP/s and memory
plan.py       --plan: parameters, FLOPs per token, bytes per device, step time, whether it fits
gpu_host.py   tracing the programs as a GPU host would (cuDNN attention included)
lowering.py   every compiled program, lowered for cuda, rocm and tpu, and what is in it
"""
