"""Unit tests of the benchmark suite (python3 -m unittest discover -s bench/tests)."""
