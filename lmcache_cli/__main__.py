"""``python -m lmcache_cli``: the same as the ``lmcache`` command."""

from lmcache_cli.main import run

run()
