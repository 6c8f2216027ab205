"""One Ray actor per GPU: probes its node, loads its own tensors, runs its stage (issue 3).

Imports flow coordinator -> worker -> offload; this package never imports `coordinator`.
"""

from worker.startup import quiet_imports

quiet_imports()  # first thing in a Ray worker process of ours: see worker.startup
