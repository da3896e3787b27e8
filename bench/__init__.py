"""GPU benchmarks and checks for score-worker (run on the GPU machine with PYTHONPATH=.)."""
