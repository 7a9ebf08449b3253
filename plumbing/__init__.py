"""Project-wide plumbing: user errors, atomic writes, progress lines, hashing, memory probes,
signals, one-line command-line errors and typed settings from plain data.

Every other package may import from here; nothing here imports anything else of the project
(tests/test_layout.py checks it), nor JAX.
"""
