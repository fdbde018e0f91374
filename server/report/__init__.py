"""report stage of the comparison server."""
