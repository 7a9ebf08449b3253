"""Muon's orthogonalisers and their polynomial coefficients (model/training/muon.py uses them).
JAX-free, so that the training config, which checks a choice against them, loads without JAX.
"""

from __future__ import annotations

ORTHOGONALIZERS = ("newton_schulz", "polar_express")

# Keller Jordan's quintic (a, b, c), the same every iteration (modded-nanogpt; optax's default).
NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)

# Polar Express (Amsel, Persson, Musco, Gower 2025, arXiv:2505.16932): one quintic per
# iteration, each the minimax-optimal odd polynomial for the interval the previous ones left,
# computed for 5 iterations with safety factor 2e-2 and cushion 2. The values are nanochat's
# (nanochat/optim.py `polar_express_coeffs`), as modded-nanogpt's speedrun uses them. Five
# iterations take singular values from [0.05, 1] x the Frobenius norm to [0.86, 1.14]
# (Newton-Schulz's five: about [0.68, 1.13]); the first three alone only to [0.16, 1.86], so
# train.muon_ns_steps must be 5 with them.
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
