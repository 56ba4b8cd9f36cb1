"""ember against the loop you would write by hand, on real models: training and evaluation timed apart.

    python benchmarks/real_workloads.py                  # full: 3 processes per allocator setting
    python benchmarks/real_workloads.py --short          # CI: a few batches, one process per setting (forked)
    python benchmarks/real_workloads.py --device cuda    # the same comparison on a GPU

Four workloads, each with its model and data from ``examples/``:

- ``word_lm``: the LSTM language model of examples/word_lm.py (2 layers of 128, bptt 35, batch 20, a
  20,000-word vocabulary, the hidden state carried across batches; SGD, gradient clipping);
- ``char_transformer``: examples/char_transformer.py (AdamW, a per-step schedule, perplexity metric);
- ``cnn``: examples/digits.py's ``CNNClassifier`` with its default steps (loss and accuracy);
- ``gan``: examples/gan.py (manual optimization, two optimizers).

The hand-written loop of each does the same computation as the module's steps (same forward, loss,
metric updates, optimizer and schedule; training losses summed as tensors, the epoch's evaluation loss
read once at its end), on a fresh copy of the same model and data, started from the same random state:
the final weights of both are compared (``bitwise equal``). ember runs with its loop alone (no
logger, progress bar, summary or checkpoint) and a callback that reads the clock at the phase
boundaries; the phases are the training batches of an epoch and the validation that follows them.

In each process, after a warm-up of both, ember and the hand loop alternate (the order swapping each
round; --short times the warm-up itself); a ratio is the median over rounds of ember's time over the hand
loop's time in the same round.
Each workload runs in its own processes, alternately with glibc's CPU allocator tuned by ember (the
default) and with ``EMBER_TUNE_CPU_ALLOCATOR=0``; in the tuned processes ember tunes the allocator in
its warm-up fit, so the hand loop that follows runs with the same allocator. Besides the same-process
ratios the script prints what the tuning does to each side's time and to the peak RSS of the process.

Goal: ember <= 1.00x of the hand-written loop in every phase (median of alternated runs, same process).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ("word_lm", "char_transformer", "cnn", "gan")
PHASES = ("train", "eval")
GOAL = 1.00
SEED = 0


# --- the workloads ------------------------------------------------------------------------------------


@dataclass
class Sizes:
    """How much of each workload one round runs."""

    epochs: int
    train_batches: int
    val_batches: int
    data: dict[str, Any] = field(default_factory=dict)


FULL = {
    "word_lm": Sizes(1, 12, 24, {"max_bytes": 1_000_000, "vocab_size": 20_000}),
    "char_transformer": Sizes(1, 30, 20, {"max_bytes": 400_000}),
    "cnn": Sizes(3, 23, 2),  # all of digits: 23 training batches of 64, 2 validation batches of 256
    "gan": Sizes(3, 64, 1),  # all of the ring: 64 batches of 128, one validation batch of 1024
}
SHORT = {
    "word_lm": Sizes(1, 3, 2, {"max_bytes": 150_000, "vocab_size": 20_000}),
    "char_transformer": Sizes(1, 3, 2, {"max_bytes": 60_000}),
    "cnn": Sizes(1, 3, 1),
    "gan": Sizes(1, 3, 1),
}


def clock() -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process): CPU time leaves out the waits for a core on a shared machine."""
    return time.perf_counter(), time.process_time()


def add(times: dict[str, float], phase: str, start: tuple[float, float], end: tuple[float, float]) -> None:
    """Add the span from `start` to `end` to ``times[phase]`` (wall) and ``times[phase + "_cpu"]``."""
    times[phase] = times.get(phase, 0.0) + end[0] - start[0]
    times[f"{phase}_cpu"] = times.get(f"{phase}_cpu", 0.0) + end[1] - start[1]


def _limited(loader: Iterable[Any], n: int) -> Iterator[Any]:
    for i, batch in enumerate(loader):
        if i == n:
            return
        yield batch


def _to(batch: Any, device: Any) -> Any:
    if isinstance(batch, (list, tuple)):
        return type(batch)(t.to(device, non_blocking=True) for t in batch)
    return batch.to(device, non_blocking=True)


class Workload:
    """One model with its data: builds fresh copies, runs the hand-written loop."""

    name = ""
    #: The validation value both loops compute (ember logs it; the hand loop reads it once per epoch).
    val_name = "val/loss"
    trainer_options: dict[str, Any] = {}

    def __init__(self, sizes: Sizes, device: Any) -> None:
        self.sizes, self.device = sizes, device
        self.data = self.make_data()
        self.data.setup("fit")

    def make_data(self) -> Any:
        raise NotImplementedError

    def make_module(self) -> Any:
        raise NotImplementedError

    def loaders(self) -> tuple[Any, Any]:
        """Fresh loaders (their generators restart), so every run sees the same batches."""
        return self.data.train_dataloader(), self.data.val_dataloader()

    def hand_fit(self, module: Any, sync: Callable[[], None]) -> dict[str, float]:
        """The hand-written loop over `sizes`: seconds of training and of evaluation."""
        raise NotImplementedError


class WordLM(Workload):
    name = "word_lm"
    trainer_options = {"gradient_clip_val": 0.25}

    def make_data(self) -> Any:
        from examples.word_lm import StdlibWords

        return StdlibWords(**self.sizes.data)

    def make_module(self) -> Any:
        from examples.word_lm import WordLSTM

        return WordLSTM(self.data.vocab_size)

    def hand_fit(self, module: Any, sync: Callable[[], None]) -> dict[str, float]:
        import torch
        from torch.nn import functional as F

        lm, s = module.model, self.sizes
        opt = torch.optim.SGD(lm.parameters(), lr=module.hparams.lr)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.25, patience=0, threshold=0)
        times: dict[str, float] = {}
        train_loader, val_loader = self.loaders()  # once: each epoch continues the loader's generator, as in ember
        for _ in range(s.epochs):
            start = clock()
            lm.train()
            hidden = None
            total = torch.zeros((), device=self.device)
            for inputs, targets in _limited(train_loader, s.train_batches):
                inputs, targets = _to((inputs, targets), self.device)
                if hidden is None:
                    hidden = lm.init_hidden(inputs.shape[1])
                logits, (h, c) = lm(inputs, hidden)
                hidden = (h.detach(), c.detach())
                loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
                loss.backward()
                torch.nn.utils.clip_grad_norm_(list(lm.parameters()), 0.25)
                opt.step()
                opt.zero_grad(set_to_none=True)
                total += loss.detach()
            sync()
            rng = torch.get_rng_state()  # ember's validation leaves the global RNG as it found it; so does this
            middle = clock()
            lm.eval()
            with torch.no_grad():
                hidden, loss_sum, tokens = None, torch.zeros((), dtype=torch.float64, device=self.device), 0
                for inputs, targets in _limited(val_loader, s.val_batches):
                    inputs, targets = _to((inputs, targets), self.device)
                    if hidden is None:
                        hidden = lm.init_hidden(inputs.shape[1])
                    logits, hidden = lm(inputs, hidden)
                    loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
                    loss_sum += len(inputs) * loss.double()
                    tokens += len(inputs)
                val_loss = float(loss_sum / tokens)
            lm.train()
            end = clock()
            torch.set_rng_state(rng)
            plateau.step(val_loss)
            times["val"] = val_loss
            add(times, "train", start, middle)
            add(times, "eval", middle, end)
        return times


class CharTransformerWorkload(Workload):
    name = "char_transformer"

    def make_data(self) -> Any:
        from examples.char_transformer import StdlibText

        return StdlibText(**self.sizes.data)

    def make_module(self) -> Any:
        from examples.char_transformer import CharTransformer

        return CharTransformer(n_layers=2, total_steps=200, warmup_steps=20)

    def hand_fit(self, module: Any, sync: Callable[[], None]) -> dict[str, float]:
        import torch
        from torch.nn import functional as F

        s = self.sizes
        # The module's own optimizer and schedule (AdamW with decay groups, warm-up then cosine).
        configured = module.configure_optimizers()
        opt, sched = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
        ppl = module.val_ppl
        times: dict[str, float] = {}
        train_loader, val_loader = self.loaders()  # once: each epoch continues the loader's generator, as in ember
        for _ in range(s.epochs):
            start = clock()
            module.train()
            total = torch.zeros((), device=self.device)
            for inputs, targets in _limited(train_loader, s.train_batches):
                inputs, targets = _to((inputs, targets), self.device)
                loss = F.cross_entropy(module(inputs).flatten(0, 1), targets.flatten())
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                sched.step()
                total += loss.detach()
            sync()
            rng = torch.get_rng_state()  # ember's validation leaves the global RNG as it found it; so does this
            middle = clock()
            module.eval()
            with torch.no_grad():
                loss_sum, count = torch.zeros((), dtype=torch.float64, device=self.device), 0
                for inputs, targets in _limited(val_loader, s.val_batches):
                    inputs, targets = _to((inputs, targets), self.device)
                    logits = module(inputs)
                    loss_sum += len(inputs) * F.cross_entropy(logits.flatten(0, 1), targets.flatten()).double()
                    ppl.update(logits, targets)
                    count += len(inputs)
                val_loss, val_ppl = float(loss_sum / count), float(ppl.compute())
                ppl.reset()
            module.train()
            end = clock()
            torch.set_rng_state(rng)
            times["val"] = val_loss
            del val_ppl
            add(times, "train", start, middle)
            add(times, "eval", middle, end)
        return times


class CNNWorkload(Workload):
    name = "cnn"

    def make_data(self) -> Any:
        from examples.digits import DigitsData

        return DigitsData(as_images=True)

    def make_module(self) -> Any:
        from examples.digits import CNNClassifier

        return CNNClassifier(epochs=self.sizes.epochs)

    def hand_fit(self, module: Any, sync: Callable[[], None]) -> dict[str, float]:
        import torch

        s = self.sizes
        configured = module.configure_optimizers()
        opt, sched = configured["optimizer"], configured["lr_scheduler"]
        model, loss_fn, accuracy = module.model, module.loss_fn, module.metrics["acc"]
        times: dict[str, float] = {}
        train_loader, val_loader = self.loaders()  # once: each epoch continues the loader's generator, as in ember
        for _ in range(s.epochs):
            start = clock()
            model.train()
            total = torch.zeros((), device=self.device)
            for inputs, targets in _limited(train_loader, s.train_batches):
                inputs, targets = _to((inputs, targets), self.device)
                loss = loss_fn(model(inputs), targets)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                total += loss.detach()
            sync()
            rng = torch.get_rng_state()  # ember's validation leaves the global RNG as it found it; so does this
            middle = clock()
            model.eval()
            with torch.no_grad():
                loss_sum, count = torch.zeros((), dtype=torch.float64, device=self.device), 0
                for inputs, targets in _limited(val_loader, s.val_batches):
                    inputs, targets = _to((inputs, targets), self.device)
                    logits = model(inputs)
                    loss_sum += len(inputs) * loss_fn(logits, targets).double()
                    accuracy.update(logits, targets)
                    count += len(inputs)
                val_loss, val_acc = float(loss_sum / count), float(accuracy.compute())
                accuracy.reset()
            model.train()
            end = clock()
            torch.set_rng_state(rng)
            times["val"] = val_loss
            del val_acc
            sched.step()
            add(times, "train", start, middle)
            add(times, "eval", middle, end)
        return times


class GANWorkload(Workload):
    name = "gan"
    val_name = "val/swd"

    def make_data(self) -> Any:
        from examples.gan import RingData

        return RingData()

    def make_module(self) -> Any:
        from examples.gan import GAN

        return GAN()

    def hand_fit(self, module: Any, sync: Callable[[], None]) -> dict[str, float]:
        import torch
        from torch.nn import functional as F

        from examples.gan import sliced_wasserstein

        s = self.sizes
        opt_g, opt_d = module.configure_optimizers()
        gen, disc, latent = module.generator, module.discriminator, module.hparams.latent_dim
        times: dict[str, float] = {}
        train_loader, val_loader = self.loaders()  # once: each epoch continues the loader's generator, as in ember
        for _ in range(s.epochs):
            start = clock()
            module.train()
            d_total, g_total = torch.zeros((), device=self.device), torch.zeros((), device=self.device)
            for (real,) in _limited(train_loader, s.train_batches):
                real = real.to(self.device, non_blocking=True)
                fake = gen(torch.randn(len(real), latent, device=real.device))
                real_logits, fake_logits = disc(real), disc(fake.detach())
                d_loss = F.binary_cross_entropy_with_logits(
                    real_logits, torch.ones_like(real_logits)
                ) + F.binary_cross_entropy_with_logits(fake_logits, torch.zeros_like(fake_logits))
                opt_d.zero_grad()
                d_loss.backward()
                opt_d.step()
                fake_logits = disc(fake)
                g_loss = F.binary_cross_entropy_with_logits(fake_logits, torch.ones_like(fake_logits))
                opt_g.zero_grad()
                g_loss.backward()
                opt_g.step()
                d_total += d_loss.detach()
                g_total += g_loss.detach()
            sync()
            rng = torch.get_rng_state()  # ember's validation leaves the global RNG as it found it; so does this
            middle = clock()
            module.eval()
            with torch.no_grad():
                distance_sum, count = torch.zeros((), dtype=torch.float64, device=self.device), 0
                for batch_idx, (real,) in enumerate(_limited(val_loader, s.val_batches)):
                    real = real.to(self.device, non_blocking=True)
                    noise_gen = torch.Generator(device=real.device).manual_seed(batch_idx)
                    z = torch.randn(len(real), latent, generator=noise_gen, device=real.device)
                    distance_sum += len(real) * sliced_wasserstein(gen(z), real, module.directions).double()
                    count += len(real)
                val_swd = float(distance_sum / count)
            module.train()
            end = clock()
            torch.set_rng_state(rng)
            times["val"] = val_swd
            add(times, "train", start, middle)
            add(times, "eval", middle, end)
        return times


CLASSES: dict[str, type[Workload]] = {c.name: c for c in (WordLM, CharTransformerWorkload, CNNWorkload, GANWorkload)}


# --- one process: warm up, then alternate ember and the hand loop --------------------------------------


def ember_fit(work: Workload, module: Any, sync: Callable[[], None]) -> dict[str, float]:
    """One ember fit over `work.sizes`: seconds of training and of evaluation, read at the phase boundaries."""
    import ember

    class PhaseClock(ember.Callback):
        """Training: epoch start to validation start; evaluation: validation start to end (not sanity checks)."""

        def __init__(self) -> None:
            self.times: dict[str, float] = {}
            self.mark = (0.0, 0.0)

        def on_train_epoch_start(self, trainer: ember.Trainer, module: ember.TrainingModule) -> None:
            self.mark = clock()

        def on_validation_start(self, trainer: ember.Trainer, module: ember.TrainingModule) -> None:
            if not trainer.sanity_checking:
                sync()
                now = clock()
                add(self.times, "train", self.mark, now)
                self.mark = now

        def on_validation_end(self, trainer: ember.Trainer, module: ember.TrainingModule) -> None:
            if not trainer.sanity_checking:
                add(self.times, "eval", self.mark, clock())
                self.times["val"] = float(trainer.callback_metrics[work.val_name])

    s, phase_clock = work.sizes, PhaseClock()
    trainer = ember.Trainer(
        max_epochs=s.epochs,
        limit_train_batches=s.train_batches,
        limit_val_batches=s.val_batches,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        accelerator="cuda" if work.device.type == "cuda" else "cpu",
        callbacks=[phase_clock],
        inference_mode=os.environ.get("EMBER_BENCH_INFERENCE_MODE") == "1",
        **work.trainer_options,
    )
    train_loader, val_loader = work.loaders()
    trainer.fit(module, train_loader, val_loader)
    return phase_clock.times


def fresh_module(work: Workload) -> Any:
    import torch

    torch.manual_seed(SEED)
    module = work.make_module().to(work.device)
    torch.manual_seed(SEED + 1)  # the state both runs start training from
    return module


def run_child(names: list[str], short: bool, rounds: int, device_name: str, threads: int) -> dict[str, Any]:
    import torch

    from ember.strategies.allocator import allocator_status

    torch.set_num_threads(threads)
    device = torch.device(device_name)
    sync: Callable[[], None] = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    results: dict[str, Any] = {}
    for name in names:
        work = CLASSES[name]((SHORT if short else FULL)[name], device)
        runs: dict[str, Callable[[], tuple[dict[str, float], Any]]] = {}

        def run_ember(work: Workload = work) -> tuple[dict[str, float], Any]:
            module = fresh_module(work)
            start = clock()
            times = ember_fit(work, module, sync)
            add(times, "fit", start, clock())
            return times, module

        def run_hand(work: Workload = work) -> tuple[dict[str, float], Any]:
            module = fresh_module(work)
            start = clock()
            times = work.hand_fit(module, sync)
            sync()
            add(times, "fit", start, clock())
            return times, module

        runs = {"ember": run_ember, "hand": run_hand}
        ember_times, ember_module = runs["ember"]()  # warm-up; ember's first fit tunes the allocator (unless off)
        hand_times, hand_module = runs["hand"]()
        equal, max_diff = compare(ember_module, hand_module)
        val = [ember_times["val"], hand_times["val"]]  # the last validation's value: logged by ember, by hand
        del ember_module, hand_module
        timings: dict[str, list[dict[str, float]]] = {"ember": [], "hand": []}
        if rounds == 0:  # --short: the warm-up runs are the timed ones (the figures mean nothing there anyway)
            timings = {"ember": [ember_times], "hand": [hand_times]}
        for round_ in range(rounds):
            for side in ("ember", "hand") if round_ % 2 == 0 else ("hand", "ember"):
                times, _ = runs[side]()
                timings[side].append(times)
        results[name] = {"timings": timings, "equal": equal, "max_diff": max_diff, "val": val}
    status = allocator_status()
    return {
        "workloads": results,
        "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "allocator": {"applied": bool(status and status.applied), "reason": status.reason if status else "not called"},
    }


def compare(a: Any, b: Any) -> tuple[bool, float]:
    """Whether two modules' weights are bitwise equal, and the largest absolute difference."""
    sa, sb = a.state_dict(), b.state_dict()
    diffs = [float((sa[k].double() - sb[k].double()).abs().max()) if sa[k].numel() else 0.0 for k in sa]
    return all(sa[k].equal(sb[k]) for k in sa), max(diffs, default=0.0)


# --- the parent: processes per allocator setting, ratios, verdict ----------------------------------------


def spawn(names: list[str], tuned: bool | None, args: argparse.Namespace) -> Any:
    """The figures of a child process running `names` with the allocator `tuned` or not; with `tuned` None, a
    process that imports once and forks one child per setting (`fork_settings`): {"tuned": ..., "not_tuned": ...}."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.pop(ALLOCATOR_VAR, None)
    if tuned is not None:
        env[ALLOCATOR_VAR] = "1" if tuned else "0"
    env["EMBER_BENCH_INFERENCE_MODE"] = "1" if args.inference_mode else "0"
    command = [sys.executable, str(Path(__file__).resolve()), "--child", ",".join(names)]
    command += ["--rounds", str(args.rounds), "--device", args.device, "--threads", str(args.threads)]
    command += ["--short"] if args.short else []
    command += ["--fork-settings"] if tuned is None else []
    out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"child {' '.join(command[2:])} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


#: Where each workload's model and data come from (what `fork_settings` imports before it forks).
EXAMPLES = {"word_lm": "examples.word_lm", "char_transformer": "examples.char_transformer",
            "cnn": "examples.digits", "gan": "examples.gan"}  # fmt: skip
ALLOCATOR_VAR = "EMBER_TUNE_CPU_ALLOCATOR"


def fork_settings(names: list[str], short: bool, rounds: int, device_name: str, threads: int) -> dict[str, Any]:
    """`run_child` with the allocator tuned and not, each in a process forked from this one after the imports.

    The allocator's setting is process-wide, so each setting needs a process of its own; forking them from one
    process that imported torch, ember and the examples (torchmetrics among them: ~6 s of CPU together) and
    constructed nothing spares the second setting those imports. Nothing here calls malloc's tuning: each child
    starts with glibc's defaults and decides as a new process would (``EMBER_TUNE_CPU_ALLOCATOR`` set in it)."""
    import importlib

    # torch._dynamo: what torch's optimizers import when the first one is built
    for module in ("torch", "torch._dynamo", "ember", *(EXAMPLES[name] for name in names)):
        importlib.import_module(module)
    results: dict[str, Any] = {}
    for setting, value in (("tuned", "1"), ("not_tuned", "0")):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: one setting, its figures (or its error) through the pipe
            os.close(read)
            code = 1
            try:
                os.environ[ALLOCATOR_VAR] = value
                figures = run_child(names, short, rounds, device_name, threads)
                os.write(write, json.dumps(figures).encode())
                code = 0
            except BaseException as error:  # reported by the parent
                os.write(write, json.dumps({"error": f"{type(error).__name__}: {error}"}).encode())
            finally:
                os._exit(code)
        os.close(write)
        with os.fdopen(read, "rb") as answer:
            results[setting] = json.loads(answer.read().decode() or '{"error": "no answer"}')
        _, status = os.waitpid(pid, 0)
        if status != 0 or "error" in results[setting]:
            raise SystemExit(f"the {setting} child failed (wait status {status}): {results[setting].get('error')}")
    return results


def median_ratio(mine: list[dict[str, float]], theirs: list[dict[str, float]], phase: str) -> float:
    return statistics.median(m[phase] / t[phase] for m, t in zip(mine, theirs, strict=True))


def median_of(runs: list[dict[str, float]], phase: str) -> float:
    return statistics.median(r[phase] for r in runs)


def val_difference(members: list[dict[str, Any]]) -> float:
    """The largest relative difference between ember's and the hand loop's last validation value."""
    return max(abs(e - h) / max(abs(h), 1e-30) for e, h in (m["val"] for m in members))


def val_agrees(members: list[dict[str, Any]]) -> bool:
    """Equal to within float32 rounding of the value (2**-23 relative: one float32 unit)."""
    return val_difference(members) <= 2.0**-23


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="a few batches, one process per setting (for CI)")
    parser.add_argument("--processes", type=int, default=3, help="processes per workload and allocator setting")
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="alternated rounds per process (default 5; short 0: the warm-up is timed)",
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in each process")
    parser.add_argument(
        "--inference-mode",
        action="store_true",
        help="ember evaluates under torch.inference_mode() (Trainer(inference_mode=True)); the hand loop keeps no_grad",
    )
    parser.add_argument("--json", help="also write the figures to this file (ratios, medians, peak RSS, agreement)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--fork-settings", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rounds is None:
        args.rounds = 0 if args.short else 5
    if args.rounds < 0 or (args.rounds == 0 and not args.short):
        parser.error(f"--rounds {args.rounds}: need at least 1 round (0 only with --short, which times the warm-up)")
    sys.path.insert(0, str(ROOT))
    if args.child:
        run = fork_settings if args.fork_settings else run_child
        print(json.dumps(run(args.child.split(","), args.short, args.rounds, args.device, args.threads)))
        return
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = [n for n in names if n not in CLASSES]
    if unknown:
        parser.error(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    # Full runs: each workload in its own processes (its own peak RSS); short: all in one process per setting,
    # both forked from one that imported once.
    children: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    started = time.perf_counter()
    if args.short:
        forked = spawn(names, None, args)
        children = {True: [forked["tuned"]], False: [check_off(forked["not_tuned"])]}
    for p in range(0 if args.short else args.processes):
        for group in [[n] for n in names]:
            for tuned in (True, False) if p % 2 == 0 else (False, True):
                child = spawn(group, tuned, args)
                children[tuned].append(child if tuned else check_off(child))
    report(names, children, args, time.perf_counter() - started)


def check_off(child: dict[str, Any]) -> dict[str, Any]:
    """`child`, a process with the tuning switched off, unless the allocator was tuned anyway."""
    if child["allocator"]["applied"]:
        raise SystemExit(f"the allocator was tuned although switched off: {child['allocator']}")
    return child


def report(names: list[str], children: dict[bool, list[dict[str, Any]]], args: argparse.Namespace, wall: float) -> None:
    def runs(tuned: bool, name: str, side: str) -> list[dict[str, float]]:
        return [t for c in children[tuned] if name in c["workloads"] for t in c["workloads"][name]["timings"][side]]

    def ratio(tuned: bool, name: str, phase: str) -> str:
        wall = median_ratio(runs(tuned, name, "ember"), runs(tuned, name, "hand"), phase)
        cpu = median_ratio(runs(tuned, name, "ember"), runs(tuned, name, "hand"), f"{phase}_cpu")
        return f"x{wall:.3f} (x{cpu:.3f})"

    def members(name: str) -> list[dict[str, Any]]:
        return [c["workloads"][name] for tuned in (True, False) for c in children[tuned] if name in c["workloads"]]

    status = children[True][0]["allocator"]
    n_rounds, n_processes = len(runs(True, names[0], "ember")), len(children[True]) // (1 if args.short else len(names))
    print(
        f"device {args.device}, {args.threads} thread(s); per workload and allocator setting {n_rounds} alternated "
        f"rounds in {n_processes} process(es); {wall:.0f} s in all"
    )
    print(f"allocator in the tuned processes: {'applied' if status['applied'] else 'NOT applied'} ({status['reason']})")
    if args.inference_mode:
        print("ember evaluates under torch.inference_mode(), the hand-written loop under torch.no_grad()")
    print("ratios: median over rounds of ember / hand-written loop in the same round; wall clock (CPU time)")
    for tuned in (True, False):
        print(f"\nallocator {'tuned (the default)' if tuned else 'not tuned (EMBER_TUNE_CPU_ALLOCATOR=0)'}:")
        print(f"  {'workload':17s} {'train':>17s} {'eval':>17s} {'whole fit':>17s}   ember ms per epoch: train, eval")
        for name in names:
            epochs = (SHORT if args.short else FULL)[name].epochs
            ms = [median_of(runs(tuned, name, "ember"), p) / epochs * 1e3 for p in PHASES]
            cells = " ".join(f"{ratio(tuned, name, p):>17s}" for p in (*PHASES, "fit"))
            print(f"  {name:17s} {cells}   {ms[0]:8.1f} {ms[1]:8.1f}")
    print("\nfinal weights, ember vs hand-written loop: ", end="")
    print(
        ", ".join(
            f"{name} "
            + (
                "bitwise equal"
                if all(m["equal"] for m in members(name))
                else f"differ (max {max(m['max_diff'] for m in members(name)):.1e})"
            )
            for name in names
        )
    )
    print("last validation value, ember's logged epoch mean vs the hand loop's float64 sum(value * n) / N: ", end="")
    print(
        ", ".join(
            f"{name} {CLASSES[name].val_name} {members(name)[0]['val'][0]:.6f} "
            + ("agree" if val_agrees(members(name)) else f"DIFFER (relative {val_difference(members(name)):.1e})")
            for name in names
        )
    )
    print("\nthe tuning: median wall time tuned / not tuned, each side across processes; peak RSS of a process")
    print(
        f"  {'workload':17s} {'ember train':>11s} {'ember eval':>11s} {'hand train':>11s} {'hand eval':>11s}"
        f"   {'peak RSS, off -> on':>25s}   ember tuned / hand not tuned: train, eval"
    )
    for name in names:
        cells = [
            median_of(runs(True, name, side), p) / median_of(runs(False, name, side), p)
            for side in ("ember", "hand")
            for p in PHASES
        ]
        cross = [median_of(runs(True, name, "ember"), p) / median_of(runs(False, name, "hand"), p) for p in PHASES]
        rss_off, rss_on = (
            statistics.median(c["maxrss_mib"] for c in children[t] if name in c["workloads"]) for t in (False, True)
        )
        print(
            f"  {name:17s} "
            + " ".join(f"{'x' + format(c, '.3f'):>11s}" for c in cells)
            + f"   {rss_off:6.0f} -> {rss_on:6.0f} MiB ({rss_on - rss_off:+5.0f})"
            + f"   x{cross[0]:.3f}, x{cross[1]:.3f}"
        )
    if args.short:
        print("(short mode: a few batches, the warm-up run timed; the figures mean nothing)")
    figures = [
        (f"{name} {phase}", median_ratio(runs(True, name, "ember"), runs(True, name, "hand"), phase))
        for name in names
        for phase in PHASES
    ]
    ok = all(value <= GOAL for _, value in figures)
    goals = ", ".join(f"{label} x{value:.3f} <= {GOAL:.2f}" for label, value in figures)
    print(f"verdict: {'meets' if ok else 'misses'} the goals (wall clock, tuned: {goals})")
    if args.json:
        summary = {
            "device": args.device,
            "short": args.short,
            "allocator": status,
            "verdict": "meets" if ok else "misses",
            "workloads": {
                name: {
                    "equal": all(m["equal"] for m in members(name)),
                    "max_diff": max(m["max_diff"] for m in members(name)),
                    "val": [m["val"] for m in members(name)],  # [ember, hand] per process
                    "val_agrees": val_agrees(members(name)),
                    **{
                        ("tuned" if tuned else "not_tuned"): {
                            "ratio": {
                                p: median_ratio(runs(tuned, name, "ember"), runs(tuned, name, "hand"), p)
                                for p in (*PHASES, "fit")
                            },
                            "ember_s": {p: median_of(runs(tuned, name, "ember"), p) for p in PHASES},
                            "hand_s": {p: median_of(runs(tuned, name, "hand"), p) for p in PHASES},
                            "peak_rss_mib": statistics.median(
                                c["maxrss_mib"] for c in children[tuned] if name in c["workloads"]
                            ),
                        }
                        for tuned in (True, False)
                    },
                }
                for name in names
            },
        }
        Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
