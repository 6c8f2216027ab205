"""The Ray-free half of the driver: the checkpoint index (what the files hold and which layer
each tensor fills), the cluster snapshot the planner sees, each node's budgets, and the planner
itself. `offloadctl plan` runs only this; a test checks that importing it never imports Ray."""
