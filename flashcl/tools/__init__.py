"""Tools that drive the backends: benchmarks, the soak run, the tuner and their timing helpers.
They sit above the public API; nothing in flashcl below them imports them (tests/test_layers.py)."""
