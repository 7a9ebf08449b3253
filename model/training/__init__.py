"""Training the GPT (the --train stage, model/train_stage.py, runs these).

config.py    TrainConfig: the [train] section
data.py      the token cache and the batches drawn from it
trainer.py   the compiled step that advances the state, evaluation
objective.py the loss the step differentiates (cross-entropy, auxiliary losses, QAT weights)
state.py     TrainState: params, optimizer state, step and key, held flat
kept_programs.py  the step, evaluation and initialisation kept compiled for the next run
loop.py      the loop: logging, evaluation, checkpoints, stopping on a signal
optim.py     AdamW or Muon (which parameters get which), warmup then cosine or warmup-stable-decay
muon.py      Muon's transforms: Newton-Schulz or Polar Express, NorMuon, cautious weight decay
muon_coefficients.py  their polynomials (JAX-free, for the config's check)
muon_split.py  Muon's orthogonalisation shared out over data-parallel devices
metrics.py   metrics.jsonl, bits per byte, MFU, the loss curve
tracking.py  train.tracker: the same metrics to TensorBoard or Weights & Biases
memory.py    will a run fit? a lower bound, then the plan, before anything is allocated
resume.py    what --resume checks and carries over
errors.py    TrainingDiverged
"""
