"""The execution engine (issue 39): today only its target adapters (`engine.targets`); the
execution core in `console/core` moves here when the adapters are wired in."""
