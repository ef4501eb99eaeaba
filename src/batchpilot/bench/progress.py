"""What ``batchpilot bench`` shows while it runs: a bar per run on a terminal, else a line per evaluation."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["Progress", "run_line"]


class Progress:
    """One tqdm bar per run on a terminal (training seconds vs budget); else a line per evaluation."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()
        self.bar: Any = None
        self.label = ""

    def note(self, text: str) -> None:
        """A line about the phase (data, calibration) on stderr."""
        if self.enabled:
            print(text, file=sys.stderr, flush=True)

    def start(self, label: str, budget_s: float) -> None:
        if not self.enabled:
            return
        self.label = label
        if self.tty:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                self.tty = False
            else:
                self.bar = tqdm(total=round(budget_s, 1), desc=label, unit="s", leave=False, file=sys.stderr,
                                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total:.0f} s train {postfix}")
                if getattr(self.bar, "disable", False):  # tqdm turned itself off: print lines instead
                    self.bar = None

    def on_eval(self, point: dict[str, Any], run: Any) -> None:
        if not self.enabled:
            return
        text = f"epoch {point['epochs']:.2f} acc {point['accuracy']:.4f} B {point['batch_size']}"
        if point.get("noise_scale") is not None:
            text += f" B_simple {point['noise_scale']:.0f}"
        if self.bar is not None:
            self.bar.n = min(round(point["time_s"], 1), self.bar.total)
            self.bar.set_postfix_str(text, refresh=True)
        else:
            print(f"  {self.label}  t={point['time_s']:6.2f}s  {text}", file=sys.stderr, flush=True)

    def finish(self, line: str) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.enabled:
            print(line, flush=True)


def run_line(label: str, run: dict[str, Any], target: float) -> str:
    """One line per finished run."""
    if run["time_to_target_s"] is not None:
        cost = run.get("cost_model_time_to_target_s")
        what = (f"reached {target:.3f} in {run['time_to_target_s']:.2f} s"
                + ("" if cost is None else f" (cost model {cost:.2f} s)")
                + f", {run['steps_to_target']} steps, {run['samples_to_target']} samples, "
                f"{run['epochs_to_target']:.2f} epochs")
    else:
        why = run.get("stop_reason") if run.get("stop_reason") in ("diverged", "stalled") else "missed"
        what = (f"{why} {target:.3f} in {run['wall_s']:.1f} s "
                f"(best {run['best_accuracy']:.4f})")
    extra = ""
    if isinstance(run.get("probe"), dict):
        extra += f"; probes {run['probe']['seconds']:.1f} s (start {run['probe']['start_size']})"
    if run.get("rollbacks"):
        extra += f"; {run['rollbacks']} rollback(s)"
    return f"{label}: {what}; final acc {run['final_accuracy']:.4f}{extra}"
