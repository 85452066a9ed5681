"""`python -m sparcoll.bench ...`: the `sparcoll bench` command without going through the project CLI."""
import argparse
import sys

from sparcoll.bench.command import add_arguments, run

parser = argparse.ArgumentParser(prog="python -m sparcoll.bench",
                                 description="Benchmark allreduce algorithms on an emulated network.")
add_arguments(parser)
sys.exit(run(parser.parse_args()))
