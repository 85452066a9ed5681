"""Benchmarks: the `sparcoll bench` command (command.py) and its parts: emulated networks (netem), inputs
(patterns), the algorithms compared, worker processes and their launcher, lower bounds, records and plots."""
