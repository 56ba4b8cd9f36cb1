"""`import ember` on top of `import torch`, each in a fresh interpreter, best of N.

    python benchmarks/import_time.py [--repeats 5]

Goal: import ember - import torch <= 0.15 s.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time


def best_of(code: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch_s = best_of("import torch", args.repeats)
    ember_s = best_of("import torch, ember", args.repeats)
    extra = ember_s - torch_s
    print(f"import torch: {torch_s:.3f} s   import torch, ember: {ember_s:.3f} s   ember adds {extra:.3f} s")
    verdict = "meets" if extra <= 0.15 else "misses"
    if args.repeats == 1:  # one lucky or unlucky run decides nothing
        verdict = "none (one repeat measures noise; run with --repeats 5 for a verdict) for"
    print(f"verdict: {verdict} the goal (ember adds {extra:.3f} s <= 0.15 s)")


if __name__ == "__main__":
    main()
