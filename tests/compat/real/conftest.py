"""tests/compat/real: LightningModules in the shape of real public ones, ported by `ember port` and trained by
both frameworks. The harness (`real_harness`) is a module beside the tests."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
