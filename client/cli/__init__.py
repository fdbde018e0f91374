"""The ``twinstep`` command line."""
