"""tests/compat: ember against Lightning itself. The bodies (`compat_bodies`) and the two runners
(`compat_harness`) are modules beside the tests."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
