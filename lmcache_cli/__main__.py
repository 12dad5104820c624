"""``python -m lmcache_cli``: the same as the ``lmcache`` command."""

from lmcache_cli.main import run

if __name__ == "__main__":  # guarded: store-bench's spawned workers import this module as __mp_main__
    run()
