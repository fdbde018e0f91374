"""compare stage of the comparison server."""
