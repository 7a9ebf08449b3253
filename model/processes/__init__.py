"""Devices and processes.

mesh.py         the device mesh and how batches and parameters are placed on it
cpu_devices.py  one CPU device per core, set before JAX starts
cpu_kernels.py  XLA's own dot kernels rather than YNNPACK's on AVX2 CPUs, set before JAX starts
distributed.py  several processes and hosts: start-up, who writes, agreeing to stop
stderr_guard.py a lost peer as one line: the filter between JAX's native stderr and the terminal
determinism.py  train.deterministic: XLA's deterministic GPU kernels, set before JAX starts
xla_flags.py    XLA_FLAGS written in one place (the user's own setting wins)
compilation_cache.py  where compiled programs are kept between processes (JAX's cache, ours)
"""
