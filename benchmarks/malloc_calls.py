"""Calls to malloc per training step, by size, of ember against a raw PyTorch loop (deterministic).

Every variant of `overhead.py` runs with a small library preloaded (compiled here with ``cc``) that counts
the calls to ``malloc``, ``calloc``, ``realloc`` and the aligned allocations, by power-of-two size class,
and writes the counts when the process exits. Each variant runs for 1 and for 3 epochs; the difference
over the 512 steps between them is what one step allocates, epoch-end work included. Unlike time and
instructions, these counts do not depend on the machine, on other processes or on where the allocator
finds memory, so a step that allocates more than before shows up as a number, not as noise.

    python benchmarks/malloc_calls.py                          # every variant of overhead.py
    python benchmarks/malloc_calls.py --variants raw "ember minimal"

Needs a C compiler (``cc``) and glibc; without a compiler it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from overhead import STEPS_PER_EPOCH, VARIANTS  # noqa: E402

SHORT, LONG = 1, 3  # epochs of the two runs per variant
KINDS = ("malloc", "calloc", "realloc", "aligned")

#: The counting library: each call adds one to its kind's counter for the size's power-of-two class, then
#: calls glibc's own function; a destructor writes "class malloc calloc realloc aligned" lines to $MALLOC_CALLS_OUT.
COUNTER_SOURCE = r"""
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
static unsigned long counts[64][4];
static void add(int kind, size_t n) {
    int c = 0;
    while (n > 1 && c < 63) { n >>= 1; c++; }
    __atomic_fetch_add(&counts[c][kind], 1, __ATOMIC_RELAXED);
}
void *malloc(size_t n) { add(0, n); return __libc_malloc(n); }
void *calloc(size_t a, size_t b) { add(1, a * b); return __libc_calloc(a, b); }
void *realloc(void *p, size_t n) { add(2, n); return __libc_realloc(p, n); }
void *memalign(size_t align, size_t n) { add(3, n); return __libc_memalign(align, n); }
void *aligned_alloc(size_t align, size_t n) { add(3, n); return __libc_memalign(align, n); }
int posix_memalign(void **out, size_t align, size_t n) {
    add(3, n);
    void *p = __libc_memalign(align, n);
    if (p == NULL) return 12;
    *out = p;
    return 0;
}
__attribute__((destructor)) static void write_counts(void) {
    const char *path = getenv("MALLOC_CALLS_OUT");
    FILE *out = path ? fopen(path, "w") : NULL;
    if (out == NULL) return;
    for (int c = 0; c < 64; c++)
        if (counts[c][0] | counts[c][1] | counts[c][2] | counts[c][3])
            fprintf(out, "%d %lu %lu %lu %lu\n", c, counts[c][0], counts[c][1], counts[c][2], counts[c][3]);
    fclose(out);
}
"""

#: size class (log2 of the size) -> calls of each kind in `KINDS`
Counts = dict[int, tuple[int, ...]]


def build_counter(directory: Path) -> Path:
    """Compile the counting library into `directory`; its path."""
    source, library = directory / "malloc_calls.c", directory / "malloc_calls.so"
    source.write_text(COUNTER_SOURCE)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return library


def parse(text: str) -> Counts:
    """The counts the library wrote."""
    counts: Counts = {}
    for line in text.splitlines():
        size_class, *calls = (int(field) for field in line.split())
        counts[size_class] = tuple(calls)
    return counts


def run(library: Path, variant: str, epochs: int, directory: Path) -> Counts:
    """The calls one run of `variant` for `epochs` epochs made."""
    out = directory / f"{variant.replace(' ', '_').replace(',', '')}-{epochs}.txt"
    env = dict(os.environ, LD_PRELOAD=str(library), MALLOC_CALLS_OUT=str(out), PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
    command = [sys.executable, str(HERE / "overhead.py"), "--run", variant, "--epochs", str(epochs)]
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"{variant!r} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return parse(out.read_text())


def per_step(short_run: Counts, long_run: Counts) -> dict[int, float]:
    """Calls per step of each size class (all kinds together), over the steps between the two runs."""
    steps = (LONG - SHORT) * STEPS_PER_EPOCH
    zero = (0,) * len(KINDS)
    return {
        size_class: (sum(long_run.get(size_class, zero)) - sum(short_run.get(size_class, zero))) / steps
        for size_class in sorted(set(short_run) | set(long_run))
    }


#: Imports overhead.py once with the counting library preloaded, then runs each "variant<TAB>epochs<TAB>out"
#: line of stdin in a child forked from there; the child exits through exit(), so the library writes its counts.
#: torch._dynamo is imported here too: torch's optimizers import it when the first one is built (~1 s of CPU in
#: every child otherwise); like every import, its calls are in both runs of a variant and cancel out.
FORKER = r"""
import os, sys, tempfile
sys.path.insert(0, sys.argv[1])
import overhead
import torch._dynamo
for line in sys.stdin:
    variant, epochs, out = line.rstrip("\n").split("\t")
    pid = os.fork()
    if pid == 0:
        os.environ["MALLOC_CALLS_OUT"] = out
        with tempfile.TemporaryDirectory() as root:
            overhead.make_variants(int(epochs), root)[variant]()
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    print("forked run exit status", status, flush=True)
"""


def run_forked(library: Path, runs: list[tuple[str, int]], directory: Path) -> list[Counts]:
    """The calls of each (variant, epochs) run, each in a child forked after the imports (see `measure`)."""
    env = dict(os.environ, LD_PRELOAD=str(library), PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
    env.pop("MALLOC_CALLS_OUT", None)
    outs = [directory / f"{variant.replace(' ', '_').replace(',', '')}-{epochs}.txt" for variant, epochs in runs]
    lines = "".join(f"{variant}\t{epochs}\t{out}\n" for (variant, epochs), out in zip(runs, outs, strict=True))
    command = [sys.executable, "-c", FORKER, str(HERE)]
    done = subprocess.run(command, input=lines, capture_output=True, text=True, check=False, env=env)
    statuses = [line.split()[-1] for line in done.stdout.splitlines() if line.startswith("forked run exit status ")]
    if done.returncode != 0 or statuses != ["0"] * len(runs) or not all(out.is_file() for out in outs):
        raise RuntimeError(f"forked runs failed ({done.returncode}, statuses {statuses}):\n{done.stderr[-2000:]}")
    return [parse(out.read_text()) for out in outs]


def measure(variants: list[str], fork: bool = False) -> dict[str, dict[int, float]]:
    """Calls per step by size class for each of `variants`.

    Each run is a new process; with `fork`, a child forked from one process that imported torch and ember
    (the imports' calls are in both runs of a variant, so the difference is the same; the tests use it to
    import once instead of once per run)."""
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        library = build_counter(directory)
        if fork:
            counts = run_forked(library, [(v, epochs) for v in variants for epochs in (SHORT, LONG)], directory)
            return {variant: per_step(counts[2 * i], counts[2 * i + 1]) for i, variant in enumerate(variants)}
        return {
            variant: per_step(run(library, variant, SHORT, directory), run(library, variant, LONG, directory))
            for variant in variants
        }


def report(results: Mapping[str, Mapping[int, float]]) -> str:
    """A table: calls per step in total and by size class, each variant against raw."""
    classes = sorted({c for per_class in results.values() for c, calls in per_class.items() if abs(calls) >= 0.05})
    bounds = " ".join(f"{'<' + str(2 ** (c + 1)):>7s}" for c in classes)
    header = f"{'variant':18s} {'total':>8s} {'vs raw':>7s} {bounds}"
    raw = sum(results["raw"].values()) if "raw" in results else None
    steps = (LONG - SHORT) * STEPS_PER_EPOCH
    lines = [f"calls to malloc per step ({steps} steps: {LONG} epochs minus {SHORT}; columns: size in bytes)", header]
    for variant, per_class in results.items():
        total = sum(per_class.values())
        versus = f"{total - raw:+7.1f}" if raw is not None else f"{'':>7s}"
        cells = " ".join(f"{per_class.get(c, 0.0):7.2f}" for c in classes)
        lines.append(f"{variant:18s} {total:8.1f} {versus} {cells}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="the variants to run (raw always runs)"
    )
    args = parser.parse_args()
    if shutil.which("cc") is None:
        print(
            "no C compiler (cc) to build the counting library (apt-get install gcc); nothing measured", file=sys.stderr
        )
        return 2
    variants = ["raw", *(variant for variant in VARIANTS if variant in args.variants and variant != "raw")]
    print(report(measure(variants)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
