"""Compress + decompress time of one fp32 tensor per compressor (no communication, no error
feedback), median over repeats, as a markdown table: what each compressor costs on the CPU before
its bytes save anything on the wire.

    python3 benchmarks/compress_timing.py [--numel 25000000] [--repeats 3] [--threads 1]
                                          [--specs topk:0.001 qsgd:8 ...]

PowerSGD is timed as one power-iteration step (its compress and decompress are one computation), on
the tensor as a padded square matrix; blocktopk with 256-element blocks.
"""
import argparse
import statistics
import time

import torch

import sparcoll.compress as sc

SPECS = ["none", "fp16", "bf16", "topk:0.01", "randomk:0.01", "threshold:2.5", "dgc:0.01",
         "qsgd:127", "terngrad", "signsgd", "efsignsgd", "onebit", "powersgd:4", "blocktopk:0.01"]


def compressor_arg(spec: str):
    try:
        return sc.make(spec)
    except ValueError as exc:       # argparse shows this message rather than "invalid value"
        raise argparse.ArgumentTypeError(str(exc)) from None


def time_once(compressor, x):
    """(compress seconds, decompress seconds, bytes on the wire)."""
    if compressor.scheme == "powersgd":
        start = time.perf_counter()
        compressor.reduce_many([x], [tuple(x.shape)], ["x"], lambda tensors: tensors)
        return time.perf_counter() - start, 0.0, compressor.payload_bytes(x.numel())
    start = time.perf_counter()
    payload = compressor.compress(x)
    middle = time.perf_counter()
    compressor.decompress(payload.parts, payload.ctx)
    end = time.perf_counter()
    if compressor.scheme == "sparse":      # sparcoll sends only the kept blocks (and their indices)
        return middle - start, end - middle, compressor.payload_bytes(x.numel())
    return middle - start, end - middle, sum(p.numel() * p.element_size() for p in payload.parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--specs", nargs="+", type=compressor_arg, default=[sc.make(s) for s in SPECS],
                        metavar="SPEC", help=sc.usage())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(0))
    print(f"{args.numel:,} float32 elements ({args.numel * 4 / 1e6:.0f} MB), {args.threads} thread(s), "
          f"median of {args.repeats}\n")
    print("| compressor | compress ms | decompress ms | total ms | bytes sent | of fp32 |")
    print("|---|---:|---:|---:|---:|---:|")
    for compressor in args.specs:
        runs = [time_once(compressor, x) for _ in range(args.repeats)]
        comp = statistics.median(r[0] for r in runs) * 1e3
        decomp = statistics.median(r[1] for r in runs) * 1e3
        total = statistics.median(r[0] + r[1] for r in runs) * 1e3
        sent = runs[-1][2]
        print(f"| {compressor.spec} | {comp:.0f} | {decomp:.0f} | {total:.0f} | {sent / 1e6:.2f} MB "
              f"| {sent / (args.numel * 4):.2%} |", flush=True)


if __name__ == "__main__":
    main()
