"""Shared pytest fixtures (kept minimal)."""

import sys
from pathlib import Path

# Make `from mp import run_ranks` work from any test folder.
sys.path.insert(0, str(Path(__file__).resolve().parent))
