"""The training-side runtime: what runs inside the training process.

``twinstep.attach`` (api.py) builds a Monitor from its settings (settings.py), installs the
capture hooks (capture/), and streams what they record through a sender (transport/).
Weight sync, batch sync, set-up collection and zero-code attach live beside them.  Users
import ``twinstep``; this package is loaded on first use.
"""
