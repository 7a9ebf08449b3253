"""Sampling from the GPT (the --inference stage, model/inference_stage.py, runs these).

config.py         SampleConfig: the [sample] section
generate.py       the token stream and its context policy
steps.py          what the compiled programs run: cache refill and decode steps
programs.py       the programs, jit-compiled or compiled ahead
program_cache.py  compiled programs and abstract models kept on disk
executables.py    a kept program stored, and loaded back (in two parts, for training)
sampling.py       temperature, top-k, top-p
sampling_params.py  SamplingParams: the settings and their one check (JAX-free)
prompts.py        prompt text -> ids; the token that ends a sample
budget.py         memory: refuse a sample count that cannot fit
clock.py          time to first token, decode rate, the timing line
"""
