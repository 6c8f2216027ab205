"""The driver: checkpoint index, planner, launcher, pipeline, telemetry, recovery; `offloadctl`."""
