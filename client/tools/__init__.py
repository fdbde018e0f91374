"""Tools built on twinstep: the demo pair of trainings, reproducer bundles."""
