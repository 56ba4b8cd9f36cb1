"""The result of a profiled run: each action's calls and times, and the table printed at the end."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ActionStats:
    """Calls and seconds of one action: ``total`` includes nested actions, ``self`` does not."""

    name: str
    calls: int = 0
    total: float = 0.0
    self: float = 0.0


@dataclass
class ProfileReport:
    """The result of one profiled run: every action, the wall time, and where it was written."""

    stage: str
    wall_s: float
    actions: list[ActionStats] = field(default_factory=list)
    path: Path | None = None
    traces: list[Path] = field(default_factory=list)

    @property
    def attributed_s(self) -> float:
        """Seconds covered by named actions (the self times of every row except the run's own)."""
        return sum(a.self for a in self.actions if a.name != self.root)

    @property
    def root(self) -> str:
        return f"{self.stage} (other)"

    def table(self) -> str:
        """The actions, most self time first, as a plain-text table."""
        rows = sorted(self.actions, key=lambda a: a.self, reverse=True)
        width = max([len(a.name) for a in rows] + [6])
        head = f"{'action':<{width}}  {'calls':>8}  {'self s':>9}  {'self %':>6}  {'mean ms':>9}  {'total s':>9}"
        lines = [f"profile of {self.stage}: {self.wall_s:.3f} s wall", head, "-" * len(head)]
        for a in rows:
            share = 100 * a.self / self.wall_s if self.wall_s > 0 else 0.0
            mean = 1000 * a.self / a.calls if a.calls else 0.0
            lines.append(
                f"{a.name:<{width}}  {a.calls:>8}  {a.self:>9.4f}  {share:>6.1f}  {mean:>9.4f}  {a.total:>9.4f}"
            )
        covered = 100 * self.attributed_s / self.wall_s if self.wall_s > 0 else 0.0
        lines.append(f"named actions cover {covered:.1f}% of the wall time")
        return "\n".join(lines)
