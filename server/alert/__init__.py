"""alert stage of the comparison server."""
