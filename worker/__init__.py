"""One Ray actor per GPU: probes its node, loads its own tensors, runs its stage (issue 3).

Imports flow coordinator -> worker -> offload; this package never imports `coordinator`.
"""
