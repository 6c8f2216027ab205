"""`offloadctl`: the command line. `main` (the entry point) and its parser in main.py; the
commands that load and inspect named loads in loads.py, the text ones (generate, serve) in
text.py, `plan` in plan.py; how a command ends (signals, the embedded Ray's release) in ending.py."""

from coordinator.cli.main import EXIT_BUG, EXIT_ERROR, build_parser, main
from coordinator.cli.plan import plan_cluster

__all__ = ["EXIT_BUG", "EXIT_ERROR", "build_parser", "main", "plan_cluster"]
