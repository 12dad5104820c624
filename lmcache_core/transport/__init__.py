"""ZMQ transport: the only place in lmcache_core that owns sockets."""

from lmcache_core.transport.client import MessageQueueClient
from lmcache_core.transport.future import MessagingFuture
from lmcache_core.transport.server import MessageQueueServer, Route

__all__ = ["MessageQueueClient", "MessageQueueServer", "MessagingFuture", "Route"]
