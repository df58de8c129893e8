"""GPU benchmark and sweep scripts (not tests): each runs as `python3 benchmarks/gpu/NAME.py`; see its docstring."""
