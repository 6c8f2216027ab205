"""The Ray half of the driver: the session, the worker group on its placement group, loading,
recovery, the Job API, telemetry and the registry of named loads."""
