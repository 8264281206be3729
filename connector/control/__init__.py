"""The connector's control plane: everything any process may import without torch."""
