"""align stage of the comparison server."""
