"""detect stage of the comparison server."""
