"""The twinstep comparison server.

    from twinstep.server import serve
    handle = serve(port=0)          # embedded; handle.address, handle.report(session), handle.stop()
"""

from twinstep.server.app import ServerHandle, serve
from twinstep.server.config import ServerConfig, load_config

__all__ = ["ServerConfig", "ServerHandle", "load_config", "serve"]
