"""Devices and processes.

mesh.py         the device mesh and how batches and parameters are placed on it
cpu_devices.py  one CPU device per core, set before JAX starts
distributed.py  several processes and hosts: start-up, who writes, agreeing to stop
"""
