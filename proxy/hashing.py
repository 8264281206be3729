"""Re-export of the shared hash definition (contracts/hashing.py); kept for existing imports."""
from __future__ import annotations

from contracts.hashing import mm_hash

__all__ = ["mm_hash"]
