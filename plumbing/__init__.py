"""Project-wide plumbing: user errors, atomic writes, progress lines, hashing, memory probes,
signals, one-line command-line errors, typed settings from plain data, imports on first use or
on a background thread at low priority, the garbage collector kept out of start-up's way, and
the exit without the interpreter's teardown.

Every other package may import from here; nothing here imports anything else of the project
(tests/test_layout.py checks it), nor JAX.
"""
