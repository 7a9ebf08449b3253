"""The run directory, the unit a user works with.

layout.py       what it holds, by file name; the checks made before any stage runs
lock.py         one writer at a time
checkpoints.py  orbax checkpoints with checksums, damaged steps moved aside
checksums.py    the checksums: one digest per array, on its devices or in numpy
trained.py      opening a trained run (float or quantized) for sampling and export
"""
