"""Speculative decoding: proposals verified in the same forward as the step's other rows."""
