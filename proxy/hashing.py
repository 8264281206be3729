"""Re-export of the shared hash definition (epd_contracts/hashing.py); kept for existing imports."""
from __future__ import annotations

from epd_contracts.hashing import mm_hash

__all__ = ["mm_hash"]
